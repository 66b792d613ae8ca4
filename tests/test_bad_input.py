"""Bad input, table-driven: every case must fail with an error naming what is at fault (the key
path, the file and line, the request, the spec), and bad acks must be counted, not crash."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from raykv.cli import main
from raykv.config import load_config
from raykv.connector.jobs import JobTable
from raykv.core.request import Request
from raykv.engine.core import EngineCore
from raykv.engine.workers import LocalWorkerGroup
from raykv.offload.directory import Directory
from raykv.workload.trace import read_trace

GOOD_LINE = '{"timestamp": 0, "input_length": 600, "output_length": 2, "hash_ids": [1, 2]}'


def cfg_error(tree: dict | None = None, sets: tuple[str, ...] = ()) -> Callable[[], object]:
    return lambda: load_config(tree, list(sets))


def yaml_file(text: str) -> Callable[[Path], object]:
    def run(tmp: Path) -> object:
        path = tmp / "bad.yaml"
        path.write_text(text)
        return load_config(path)

    return run


def trace_file(*lines: str) -> Callable[[Path], object]:
    def run(tmp: Path) -> object:
        path = tmp / "t.jsonl"
        path.write_text("\n".join(lines) + "\n")
        return read_trace(path)

    return run


def engine_request(req: Callable[[], Request], blocks: int = 8) -> Callable[[], object]:
    def run() -> object:
        cfg = load_config(None, [f"cache.num_gpu_blocks={blocks}", "cache.block_size=4"])
        with LocalWorkerGroup(cfg, 4, threaded=False) as workers:
            engine = EngineCore(cfg, workers)
            engine.add_request(Request("first", 0, [1, 2, 3], 2))
            return engine.add_request(req())

    return run


CASES: list[tuple[str, Callable, str]] = [
    (
        "malformed yaml",
        yaml_file("offload:\n  cpu_bytes: [1,\n"),
        r"bad\.yaml:\d+:\d+: malformed YAML",
    ),
    ("yaml list at top", yaml_file("- 1\n"), "top level must be a mapping"),
    ("yaml object tag", yaml_file("x: !!python/object/apply:os.getcwd []\n"), "malformed YAML"),
    ("unknown section", cfg_error({"offlaod": {}}), "offlaod: unknown key"),
    ("unknown key", cfg_error({"offload": {"polcy": "lru"}}), "offload.polcy: unknown key"),
    ("bool wanted", cfg_error({"offload": {"enabled": "maybe"}}), "offload.enabled"),
    ("int wanted", cfg_error({"cache": {"block_size": "big"}}), "cache.block_size"),
    ("too few blocks", cfg_error({"cache": {"num_gpu_blocks": 1}}), "cache.num_gpu_blocks"),
    ("bad size", cfg_error({"offload": {"cpu_bytes": "2XB"}}), "offload.cpu_bytes: not a size"),
    (
        "pool under a chunk",
        cfg_error({"offload": {"cpu_bytes": 100}}),
        r"offload.cpu_bytes \(100\) is smaller than one chunk",
    ),
    (
        "block bigger than the pool",
        cfg_error({"offload": {"cpu_bytes": "1MiB"}, "model": {"num_layers": 64, "head_dim": 128}}),
        "smaller than one chunk",
    ),
    ("two sizes", cfg_error({"offload": {"cpu_bytes": "1GiB", "cpu_slots": 4}}), "exclusive"),
    (
        "tp vs heads",
        cfg_error({"parallel": {"tensor_parallel_size": 3}}),
        r"parallel.tensor_parallel_size \(3\) must divide model.num_kv_heads \(4\)",
    ),
    (
        "layers vs groups",
        cfg_error(
            {
                "model": {"num_layers": 3},
                "cache": {
                    "groups": [
                        {"kind": "full_attention"},
                        {"kind": "sliding_window", "window_tokens": 8},
                    ]
                },
            }
        ),
        r"model.num_layers \(3\)",
    ),
    (
        "window missing",
        cfg_error({"cache": {"groups": [{"kind": "sliding_window"}]}}),
        "cache.groups.0: a sliding_window group needs window_tokens",
    ),
    (
        "window on full",
        cfg_error({"cache": {"groups": [{"window_tokens": 8}]}}),
        "window_tokens applies only",
    ),
    ("group kind", cfg_error({"cache": {"groups": [{"kind": "linear"}]}}), "cache.groups.0.kind"),
    ("dtype", cfg_error({"model": {"dtype": "fp8"}}), "model.dtype"),
    ("device", cfg_error({"parallel": {"device": "tpu"}}), "parallel.device"),
    ("policy syntax", cfg_error({"offload": {"policy": "a b"}}), "offload.policy"),
    ("policy unknown", lambda: Directory(4, "nope"), "unknown policy 'nope'"),
    ("policy import", lambda: Directory(4, "no.such.module:Cls"), "cannot load policy"),
    ("trace kind", cfg_error({"workload": {"kind": "trace"}}), "needs a trace file"),
    ("set path", cfg_error(None, ("offload..policy=x",)), "--set offload..policy: empty key"),
    ("set value", cfg_error(None, ("offload.cpu_slots=[1",)), "not valid YAML"),
    ("fault in config", cfg_error({"faults": ["explode:rate=1"]}), "fault 'explode:rate=1'"),
    ("trace json", trace_file(GOOD_LINE, "{oops"), r"t\.jsonl:2: not valid JSON"),
    (
        "trace field",
        trace_file('{"timestamp": 0, "input_length": 5, "output_length": 1}'),
        r"t\.jsonl:1: missing field 'hash_ids'",
    ),
    (
        "trace ids",
        trace_file('{"timestamp": 0, "input_length": 2000, "output_length": 1, "hash_ids": [1]}'),
        "1 hash_ids for input_length 2000",
    ),
    (
        "trace time",
        trace_file('{"timestamp": -5, "input_length": 5, "output_length": 1, "hash_ids": [1]}'),
        "'timestamp' must be >= 0",
    ),
    (
        "trace bool",
        trace_file('{"timestamp": 0, "input_length": true, "output_length": 1, "hash_ids": [1]}'),
        "'input_length' must be int",
    ),
    (
        "request too long",
        engine_request(lambda: Request("big", 1, list(range(40)), 4)),
        r"request big: 40 prompt \+ 4 output tokens need \d+ GPU blocks; the pool has 7",
    ),
    (
        "token id",
        engine_request(lambda: Request("bad", 1, [5, 99999], 1)),
        r"request bad: token id 99999 outside \[0, 32000\)",
    ),
    (
        "duplicate id",
        engine_request(lambda: Request("first", 1, [5], 1)),
        "duplicate request id 'first'",
    ),
    ("empty prompt", lambda: Request("e", 0, [], 1), "request e: empty prompt"),
    ("no tokens wanted", lambda: Request("z", 0, [1], 0), "request z: max_tokens must be positive"),
]


@pytest.mark.parametrize("name,call,message", CASES, ids=[c[0] for c in CASES])
def test_bad_input_names_the_culprit(name, call, message, tmp_path) -> None:
    with pytest.raises(ValueError, match=message):
        call(tmp_path) if call.__code__.co_argcount == 1 else call()


def test_enough_cases() -> None:
    assert len(CASES) >= 30


def test_bad_acks_are_counted_and_ignored() -> None:
    table = JobTable(num_ranks=2)
    job = table.create("r", [1], is_store=True)
    assert table.ack(12345, 0) is None  # never existed
    assert table.ack(job.job_id, 0) is None
    assert table.ack(job.job_id, 0) is None  # duplicated
    assert table.ack(job.job_id, 5) is None  # no such rank
    stale = table.create("r", [2], is_store=True)
    table.reset()
    assert table.ack(stale.job_id, 0) is None  # from before a reset
    s = table.stats
    assert (s.unknown, s.duplicate, s.bad_rank, s.stale) == (1, 1, 1, 1)


@pytest.mark.parametrize(
    "argv,message",
    [
        (["run", "--workload", "bogus"], "expected synthetic or trace:FILE"),
        (["run", "--fault", "explode:rate=1"], "unknown kind 'explode'"),
        (
            ["run", "--engine", "local", "--fault", "kill-scheduler:step=3"],
            "kill-scheduler needs the Ray engine",
        ),
        (["run", "--config", "no/such.yaml"], "cannot read config"),
        (["config", "check", "no/such.yaml"], "cannot read config"),
        (["bench", "serve", "--router", "kv,best"], "--router 'best': expected some of"),
        (["bench", "serve", "--workload", "trace:no/such.jsonl"], "no trace file at"),
        (["bench", "serve", "--workload", "mooncake"], "expected synthetic or trace:FILE"),
        (["serve", "--router", "best"], "--router 'best': expected one of"),
        (["serve", "--host", "0.0.0.0"], "needs --api-key KEY"),
    ],
)
def test_cli_reports_bad_input_and_exits_2(argv, message, capsys) -> None:
    assert main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "section,flags,message",
    [
        # the file's host is read: beyond loopback it needs a key
        ("serve:\n  host: 0.0.0.0\n", [], "--host 0.0.0.0: serving beyond this machine"),
        # a flag wins over the file's key
        ("serve:\n  router: pow2\n", ["--router", "best"], "--router 'best': expected one of"),
        ("serve:\n  router: best\n", [], "serve.router"),
        ("serve:\n  replicas: 0\n", [], "serve.replicas"),
    ],
)
def test_serve_reads_its_config_files_serve_section(
    tmp_path, section, flags, message, capsys
) -> None:
    path = tmp_path / "serve.yaml"
    path.write_text(section)
    assert main(["serve", "--config", str(path), *flags]) == 2
    assert message in capsys.readouterr().err


# ---- issue 10, defect 5: bad input that crashed (exit 1, a traceback) instead of naming it ----


def _one_line_error(capsys) -> str:
    """What main() printed to stderr, asserted to be a single error line without a traceback."""
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines and lines[-1].startswith("raykv: error: "), err
    return err


def test_issue10_a_trace_line_below_one_block_without_hash_ids(tmp_path, capsys) -> None:
    trace = tmp_path / "short.jsonl"
    trace.write_text(
        GOOD_LINE + '\n{"timestamp": 1, "input_length": 100, "output_length": 2, "hash_ids": []}\n'
    )
    argv = ["run", "--engine", "local", "--config", "configs/synthetic.yaml"]
    assert main([*argv, "--workload", f"trace:{trace}", "--num-requests", "2"]) == 2
    err = _one_line_error(capsys)
    assert "short.jsonl:2: 0 hash_ids for input_length 100; expected 1" in err
    with pytest.raises(ValueError, match=r"short\.jsonl:2: 0 hash_ids"):
        read_trace(trace)  # the policy bench reads the same lines


def test_issue10_b_policy_name_checked_at_config_load(capsys) -> None:
    assert main(["config", "check", "configs/synthetic.yaml", "--set", "offload.policy=lfu"]) == 2
    err = _one_line_error(capsys)
    assert "offload.policy: unknown policy 'lfu' (known: arc, lru, recall)" in err
    assert "configs/synthetic.yaml: ok" not in capsys.readouterr().out


@pytest.mark.parametrize(
    "spec,message",
    [
        ("lfu", r"offload\.policy: unknown policy 'lfu'"),
        ("no.such.module:Cls", r"offload\.policy: cannot load policy 'no\.such\.module:Cls'"),
        ("raykv.offload.policies:NoSuch", r"offload\.policy: cannot load policy"),
        ("raykv.config:RaykvConfig", r"offload\.policy: policy .* is not a CachePolicy subclass"),
        ("boom_policy:Policy", r"offload\.policy: cannot load policy 'boom_policy:Policy'.*boom"),
    ],
)
def test_issue10_b_policy_spec_refused_naming_the_key(spec, message, tmp_path, monkeypatch):
    (tmp_path / "boom_policy.py").write_text("raise RuntimeError('boom at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match=message):
        load_config(None, [f"offload.policy={spec}"])


def test_issue10_b_policy_import_path_accepted() -> None:
    spec = "raykv.offload.policies.lru:LRUPolicy"
    assert load_config(None, [f"offload.policy={spec}"]).offload.policy == spec


def test_issue10_c_cuda_device_without_cuda_is_one_line(capsys, monkeypatch) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    base = ["run", "--config", "configs/synthetic.yaml", "--set", "parallel.device=cuda"]
    assert main([*base, "--engine", "local", "--num-requests", "2"]) == 2
    err = _one_line_error(capsys)
    assert "parallel.device: cuda: CUDA is not available on this machine" in err


def test_issue10_c_cuda_device_without_cuda_refused_before_ray_deploys(capsys, monkeypatch):
    """On an embedded Ray the ranks would wait 300 s for GPUs that do not exist, then fail."""
    import torch

    from raykv.cluster.client import RaykvClient

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    base = ["run", "--config", "configs/synthetic.yaml", "--set", "parallel.device=cuda"]

    def deploy(*args, **kwargs):
        raise AssertionError("deployment started with parallel.device: cuda and no CUDA")

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(RaykvClient, "start", deploy)
    assert main([*base, "--num-requests", "2"]) == 2
    assert "parallel.device: cuda: CUDA is not available" in _one_line_error(capsys)


def test_issue10_c_device_problem_says_why() -> None:
    import torch

    from raykv.transfer.devices import device_problem

    assert device_problem("cpu") is None
    if not torch.cuda.is_available():
        assert "CUDA is not available on this machine" in (device_problem("cuda") or "")
    else:
        n = torch.cuda.device_count()
        assert device_problem("cuda", n) is None
        assert f"this machine has {n}" in (device_problem("cuda", n + 1) or "")


@pytest.mark.parametrize(
    "spec",
    ["kill-worker:step=5:rank=7", "kill-worker:step=5:rank=2", "delay-acks:rank=2:steps=3"],
)
def test_issue10_d_fault_rank_beyond_tp_refused(spec, capsys) -> None:
    with pytest.raises(ValueError, match=rf"fault '{spec}': rank \d+ .*tensor_parallel_size"):
        load_config(None, ["parallel.tensor_parallel_size=2", f"faults=[{spec!r}]"])
    argv = ["run", "--engine", "local", "--config", "configs/synthetic.yaml", "--num-requests", "2"]
    assert main([*argv, "--set", "parallel.tensor_parallel_size=2", "--fault", spec]) == 2
    err = _one_line_error(capsys)
    assert f"fault {spec!r}: rank" in err


def test_issue10_d_fault_rank_within_tp_accepted() -> None:
    cfg = load_config(
        None, ["parallel.tensor_parallel_size=2", "faults=['kill-worker:step=5:rank=1']"]
    )
    assert cfg.faults == ["kill-worker:step=5:rank=1"]


def test_issue10_e_kill_scheduler_takes_a_seed() -> None:
    from raykv.faults import parse_fault

    fault = parse_fault("kill-scheduler:step=5:seed=3")
    assert (fault.kind, fault.step, fault.seed) == ("kill-scheduler", 5, 3)
    assert load_config(None, ["faults=['kill-scheduler:step=5:seed=3']"]).faults


# ---- the same kind of bad input found elsewhere in the CLI ----


def test_config_not_utf8_names_the_file(tmp_path) -> None:
    path = tmp_path / "latin1.yaml"
    path.write_bytes(b"offload:\n  policy: lru # caf\xe9\n")
    with pytest.raises(ValueError, match=r"latin1\.yaml: not UTF-8 text"):
        load_config(path)


def test_trace_not_utf8_names_the_line(tmp_path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes(GOOD_LINE.encode() + b"\n" + b'{"note": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=r"t\.jsonl:2: not UTF-8 text"):
        read_trace(path)


@pytest.mark.parametrize(
    "flag,value", [("--block-tokens", "0"), ("--repeat", "0"), ("--limit", "0"), ("--limit", "-1")]
)
def test_bench_policy_counts_must_be_positive(flag, value, tmp_path, capsys) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(GOOD_LINE + "\n")
    argv = ["bench", "policy", "--trace", str(trace), "--capacity-tokens", "1000", flag, value]
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: expected a positive integer, got {value!r}" in err


def test_json_report_into_a_missing_directory_is_refused_before_the_run(tmp_path, capsys):
    out = tmp_path / "no" / "such" / "report.json"
    argv = ["run", "--engine", "local", "--config", "configs/synthetic.yaml", "--num-requests", "2"]
    assert main([*argv, "--json-report", str(out)]) == 2
    err = _one_line_error(capsys)
    assert f"--json-report {out}: no such directory" in err
    assert "requests" not in capsys.readouterr().out  # nothing ran
