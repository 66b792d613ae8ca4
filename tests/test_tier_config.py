"""The tiers' settings that used to pass the check and fail at start (or never): each is refused
when the config is read, in one line naming its key."""

from __future__ import annotations

import os

import pytest

from raykv.config import ConfigError, load_config
from raykv.config.shared import SECRET_ENV, cluster_secret

SHARED = ["offload.shared.enabled=true"]
EXTERNAL = [*SHARED, "offload.shared.master=127.0.0.1:50051"]


@pytest.mark.parametrize(
    ("sets", "key", "why"),
    [
        (["offload.shared.segment=10"], r"offload\.shared", "16MiB or more"),
        (["offload.shared.timeout_s=inf"], r"offload\.shared\.timeout_s", "finite"),
        (["offload.shared.timeout_s=1e9"], r"offload\.shared\.timeout_s", "less than or equal"),
        (
            ["offload.shared.mount=false", "offload.shared.segment=100"],
            r"offload\.shared\.segment",
            "smaller than one chunk",
        ),
    ],
)
def test_shared_tier_values_that_cannot_work_are_refused_by_name(
    sets: list[str], key: str, why: str
) -> None:
    """``segment=10`` and ``timeout_s=inf`` passed the check and failed at start naming
    ``offload.shared.master``."""
    with pytest.raises(ConfigError, match=key) as caught:
        load_config(None, [*SHARED, *sets])
    assert why in str(caught.value) and "\n" not in str(caught.value)


def test_an_external_master_needs_the_clusters_secret(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(SECRET_ENV, raising=False)
    with pytest.raises(ConfigError, match=r"offload\.shared.*secret_file.*RAYKV_SHARED_SECRET"):
        load_config(None, EXTERNAL)
    embedded = load_config(None, SHARED)  # an embedded master makes its own
    assert embedded.offload.shared.secret_file is None
    secret = tmp_path / "secret"
    secret.write_text("0123456789abcdef-the-cluster's-secret\n")
    secret.chmod(0o600)
    cfg = load_config(None, [*EXTERNAL, f"offload.shared.secret_file={secret}"])
    assert cluster_secret(cfg.offload.shared) == b"0123456789abcdef-the-cluster's-secret"
    monkeypatch.setenv(SECRET_ENV, "a secret from the environment")
    assert cluster_secret(load_config(None, EXTERNAL).offload.shared) == (
        b"a secret from the environment"
    )


@pytest.mark.timeout(30)
@pytest.mark.parametrize("what", ["short", "fifo", "directory", "missing"])
def test_a_secret_file_that_holds_no_secret_is_refused_by_name(tmp_path, what: str) -> None:
    """A FIFO is refused without waiting for a writer."""
    path = tmp_path / "secret"
    if what == "short":
        path.write_text("too short")
    elif what == "fifo":
        os.mkfifo(path, 0o600)
    elif what == "directory":
        path.mkdir()
    with pytest.raises(ConfigError, match=r"offload\.shared\.secret_file"):
        load_config(None, [*EXTERNAL, f"offload.shared.secret_file={path}"])
