"""How the processes of a vLLM engine agree on the disk and shared tiers' namespace, without an
engine (``raykv/vllm/namespace.py``): the workers post, the manager composes and publishes, the
workers say where their engines are, a reset starts it again; on a test clock."""

from __future__ import annotations

from raykv.vllm.namespace import NamespaceAgreement, NamespaceBoard, digest

BASE = {"format": 2, "engine": "vllm", "tensor_parallel_size": 2, "world_size": 2}
MODEL = {"hf_config": {"rope_theta": 1e4}, "dtype": "torch.float32"}


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def agreement(tmp_path, opened: list) -> tuple[NamespaceAgreement, NamespaceBoard, Clock]:
    board = NamespaceBoard(str(tmp_path), 2)
    clock = Clock()

    def open_tiers(parts, store, roots):
        opened.append((parts, roots))
        return []

    return NamespaceAgreement(board, BASE, open_tiers, clock=clock), board, clock


def test_the_namespace_is_composed_once_every_rank_posted_and_used_once_all_are_ready(
    tmp_path,
) -> None:
    agreed, _, _ = agreement(tmp_path, [])
    worker = NamespaceBoard(str(tmp_path), 2)  # a worker process's own view of the files
    assert agreed.poll() is None
    worker.post(0, 0, MODEL, "weights-of-rank-0")
    assert agreed.poll() is None and worker.namespace(0) is None
    worker.post(0, 1, MODEL, "weights-of-rank-1")
    assert agreed.poll() is None  # composed and published, not yet built
    parts = worker.namespace(0)
    assert parts is not None and parts["weights"] == ["weights-of-rank-0", "weights-of-rank-1"]
    worker.ready(0, 0, "/disk/ns/rank-0")
    worker.ready(0, 1, "/disk/ns/rank-1.1")  # another engine on the node holds rank-1
    assert agreed.poll() == parts
    assert agreed.disk_roots == ["/disk/ns/rank-0", "/disk/ns/rank-1.1"]


def test_other_weights_or_another_seed_are_another_namespace_and_a_reset_posts_again(
    tmp_path,
) -> None:
    agreed, board, _ = agreement(tmp_path, [])
    for rank in (0, 1):
        board.post(0, rank, MODEL, f"w{rank}")
        board.ready(0, rank, None)
    first = agreed.poll()
    assert first is not None
    agreed.next_epoch()
    assert board.epoch() == 1 and NamespaceBoard(str(tmp_path), 2).epoch() == 1
    assert board.posts(0) is None  # the epoch before's files are gone
    for rank in (0, 1):
        board.post(1, rank, MODEL, f"new-w{rank}")
        board.ready(1, rank, None)
    second = agreed.poll()
    assert second is not None and digest(second) != digest(first)


def test_lookups_ask_again_for_a_while_from_the_first_that_needed_the_namespace(
    tmp_path,
) -> None:
    """Found by review: the while ran from the manager's start, and a restarted engine idle for
    more than it before its first request had that request miss the disk."""
    agreed, _, clock = agreement(tmp_path, [])
    clock.now += 60.0  # idle, nothing steps the engine
    assert agreed.waiting()
    clock.now += agreed.wait_s / 2
    assert agreed.waiting()
    clock.now += agreed.wait_s
    assert not agreed.waiting()
    agreed.next_epoch()  # a reset: a while of its own
    clock.now += 60.0
    assert agreed.waiting()


def test_ranks_that_run_differently_configured_models_never_agree(tmp_path) -> None:
    agreed, board, _ = agreement(tmp_path, [])
    board.post(0, 0, MODEL, "w0")
    board.post(0, 1, {**MODEL, "dtype": "torch.bfloat16"}, "w1")
    assert agreed.poll() is None and board.namespace(0) is None
