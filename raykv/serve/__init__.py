"""``raykv serve``: an OpenAI-compatible server on Ray Serve, its replicas and the KV-aware
router.

``raykv.cluster`` first: it keeps an embedded Ray on the loopback interface, which works only if
set before ray is first imported, and every module here imports ray.
"""

import raykv.cluster  # noqa: F401
