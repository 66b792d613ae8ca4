"""raykv on Ray: the scheduler actor, one worker actor per rank, the client API.

Ray's servers bind to every interface on Linux unless told otherwise; this environment variable,
set before ray is first imported, keeps an embedded instance on the loopback interface.
"""

import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
