"""Bad input, table-driven: every case must fail with an error naming what is at fault (the key
path, the file and line, the request, the spec), and bad acks must be counted, not crash."""

from __future__ import annotations

import json
import os
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


# ---- issue 28, finding 6: bad input files end in exit 2 with one line naming the culprit ----


def _the_error_line(capsys) -> str:
    """The one line main() printed to stderr: an error, no traceback, nothing else."""
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("raykv: error: "), err
    return lines[0]


def _bad_trace(tmp_path: Path, line: str) -> Path:
    """A trace whose second line is ``line`` between two good ones (arriving at 0 and 5 ms)."""
    path = tmp_path / "t.jsonl"
    path.write_text(f"{GOOD_LINE}\n{line}\n{_trace_line(timestamp='5')}\n")
    return path


def _trace_line(**fields: object) -> str:
    """A good trace line with ``fields`` replaced, each given as its JSON text."""
    values = {"timestamp": "1", "input_length": "600", "output_length": "2", "hash_ids": "[1, 2]"}
    values.update({name: str(text) for name, text in fields.items()})
    return "{" + ", ".join(f'"{name}": {text}' for name, text in values.items()) + "}"


def _policy_bench(trace: Path) -> list[str]:
    return ["bench", "policy", "--trace", str(trace), "--capacity-tokens", "1000"]


def test_issue28_6_trace_timestamp_not_finite_ends_the_run_before_it_starts(tmp_path, capsys):
    """The reported case: a NaN arrival stalled the run until RunStalled."""
    trace = _bad_trace(tmp_path, _trace_line(timestamp="NaN"))
    argv = ["run", "--engine", "local", "--config", "configs/synthetic.yaml"]
    assert main([*argv, "--workload", f"trace:{trace}", "--num-requests", "3"]) == 2
    line = _the_error_line(capsys)
    assert f"{trace}:2: field 'timestamp' must be a finite number, got nan" in line


@pytest.mark.parametrize("text", ["NaN", "Infinity", "-Infinity", "1e999", "-1e999"])
@pytest.mark.parametrize("field", ["timestamp", "input_length", "output_length"])
def test_issue28_6_trace_numbers_not_finite(tmp_path, capsys, field, text) -> None:
    trace = _bad_trace(tmp_path, _trace_line(**{field: text}))
    assert main(_policy_bench(trace)) == 2
    line = _the_error_line(capsys)
    assert f"{trace}:2: field {field!r}" in line


@pytest.mark.parametrize(
    "field,text",
    [
        ("timestamp", "1e308"),  # finite, but a replay on the wall clock waits forever for it
        ("timestamp", "1" + "0" * 400),  # beyond a float
        ("input_length", "1" + "0" * 30),
        ("input_length", "1" + "0" * 400),
        ("input_length", "1e308"),
        ("input_length", "600.0"),
        ("input_length", "600.5"),
        ("output_length", "1" + "0" * 30),
        ("output_length", "2.0"),
        ("output_length", "false"),
        ("output_length", '"2"'),
        ("output_length", "null"),
        ("timestamp", '"1"'),
        ("timestamp", "true"),
        ("hash_ids", "[1, NaN]"),
        ("hash_ids", "[1, Infinity]"),
        ("hash_ids", "[1, 2.0]"),
        ("hash_ids", "[1, true]"),
        ("hash_ids", "[1, -2]"),
        ("hash_ids", "[1, " + "1" + "0" * 30 + "]"),
        ("hash_ids", '[1, "2"]'),
        ("hash_ids", "[1, [2]]"),
        ("hash_ids", "null"),
    ],
)
def test_issue28_6_trace_poison_numbers_name_the_line_and_field(tmp_path, capsys, field, text):
    trace = _bad_trace(tmp_path, _trace_line(**{field: text}))
    assert main(_policy_bench(trace)) == 2
    line = _the_error_line(capsys)
    assert f"{trace}:2: field {field!r}" in line
    assert len(line) < 300  # a 400-digit number is not printed whole


@pytest.mark.parametrize(
    "line",
    [
        _trace_line(timestamp="1" * 5000),  # more digits than Python converts
        _trace_line(hash_ids="[1, 2]", note="[" * 100_000 + "]" * 100_000),  # nested too deep
    ],
    ids=["too many digits", "nested too deep"],
)
def test_issue28_6_trace_json_the_parser_refuses_names_the_line(tmp_path, capsys, line) -> None:
    trace = _bad_trace(tmp_path, line)
    assert main(_policy_bench(trace)) == 2
    assert f"{trace}:2: not valid JSON" in _the_error_line(capsys)


def test_issue28_6_trace_good_numbers_still_read(tmp_path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        _trace_line(timestamp="1.7e12", output_length="0")  # epoch milliseconds
        + "\n"
        + _trace_line(timestamp="1700000000123", hash_ids="[18446744073709551615, 0]")
        + "\n"
    )
    first, second = read_trace(trace)
    assert (first.timestamp, first.output_length) == (1.7e12, 0)
    assert second.timestamp == 1700000000123.0 and second.hash_ids == (2**64 - 1, 0)


# -- raykv generate --prompt-file


LLAMA_CONFIG = {
    "model_type": "llama",
    "vocab_size": 97,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "eos_token_id": 1,
}


def _write_weights(path: Path, without: str | None = None) -> Path:
    """A valid safetensors file with every tensor ``LLAMA_CONFIG``'s model reads (but
    ``without``), each a one-element stand-in: configure reads the names in its header, and
    no test here runs the model."""
    import numpy as np
    from safetensors.numpy import save_file

    from raykv.model.spec import ModelSpec

    names = ModelSpec.from_hf_config(LLAMA_CONFIG).required_tensors()
    tensors = {name: np.ones(1, dtype=np.float32) for name in names if name != without}
    save_file(tensors, str(path))
    return path


def _model_dir(tmp_path: Path, config: object = None, weights: bool = True) -> Path:
    """A checkpoint directory: ``config`` as its config.json (a dict, or the file's text)."""
    root = tmp_path / "model"
    root.mkdir(exist_ok=True)
    config = LLAMA_CONFIG if config is None else config
    text = config if isinstance(config, str) else json.dumps(config)
    (root / "config.json").write_text(text)
    if weights:
        _write_weights(root / "model.safetensors")
    return root


@pytest.fixture(scope="module")
def chat_tokenizer_files(tmp_path_factory) -> Path:
    """A word-level tokenizer of 97 words with a chat template that reads role and content
    (made offline, in a second)."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    words = ["[UNK]", "</s>", *(f"w{i}" for i in range(95))]
    model = tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]")
    backend = tokenizers.Tokenizer(model)
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    template = (
        "{% for m in messages %}{{ m['role'] + ': ' + m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}w1{% endif %}"
    )
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="[UNK]", eos_token="</s>", chat_template=template
    )
    out = tmp_path_factory.mktemp("chat-tokenizer")
    tokenizer.save_pretrained(str(out))
    return out


def _chat_model_dir(tmp_path: Path, tokenizer_files: Path) -> Path:
    import shutil

    root = _model_dir(tmp_path)
    for file in tokenizer_files.iterdir():
        shutil.copy(file, root / file.name)
    return root


def _generate(model: Path, prompts: Path) -> list[str]:
    return ["generate", "--model", str(model), "--prompt-file", str(prompts), "--max-tokens", "2"]


@pytest.mark.parametrize(
    "messages,culprit",
    [
        ([{"content": "w3"}], "messages[0]: missing 'role'"),
        ([{"role": "user"}], "messages[0]: missing 'content'"),
        ([{"role": "user", "content": "w3"}, {"role": "assistant"}], "messages[1]: missing"),
        (["w3"], "messages[0]: expected an object"),
        ([{"role": 1, "content": "w3"}], "messages[0]: 'role' must be a non-empty string"),
        ([{"role": "user", "content": None}], "messages[0]: 'content' must be a string"),
        ([{"role": "user", "content": ["w3"]}], "messages[0]: 'content' must be a string"),
        ([{"role": "", "content": "w3"}], "messages[0]: 'role' must be a non-empty string"),
    ],
)
def test_issue28_6_prompt_file_bad_messages_name_the_line_and_message(
    tmp_path, capsys, chat_tokenizer_files, messages, culprit
) -> None:
    model = _chat_model_dir(tmp_path, chat_tokenizer_files)
    prompts = tmp_path / "prompts.jsonl"
    good = {"messages": [{"role": "user", "content": "w2"}]}
    prompts.write_text(json.dumps(good) + "\n" + json.dumps({"messages": messages}) + "\n")
    assert main(_generate(model, prompts)) == 2
    assert f"{prompts}:2: {culprit}" in _the_error_line(capsys)


@pytest.mark.parametrize(
    "line,culprit",
    [
        ('{"prompt": ""}', "prompt is empty"),
        ('{"messages": []}', "messages is empty"),
        ('{"prompt_token_ids": []}', "prompt_token_ids is empty"),
        ('{"prompt_token_ids": [1, -2]}', "prompt_token_ids[1]"),
        ('{"prompt_token_ids": [1, true]}', "prompt_token_ids[1]"),
        ('{"prompt_token_ids": [1, 2.0]}', "prompt_token_ids[1]"),
        ('{"prompt_token_ids": [1, NaN]}', "prompt_token_ids[1]"),
        ('{"prompt_token_ids": [1, "2"]}', "prompt_token_ids[1]"),
        ('{"prompt_token_ids": [1, null]}', "prompt_token_ids[1]"),
        ('{"prompt_token_ids": "12"}', "prompt_token_ids has the wrong type: it must be a list"),
        ('{"prompt_token_ids": [' + "1" * 5000 + "]}", "not JSON"),
        ('{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}", "not JSON"),
    ],
)
def test_issue28_6_prompt_file_bad_prompts_name_the_line(
    tmp_path, capsys, chat_tokenizer_files, line, culprit
) -> None:
    model = _chat_model_dir(tmp_path, chat_tokenizer_files)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt_token_ids": [1, 2]}\n\n' + line + "\n")
    assert main(_generate(model, prompts)) == 2
    assert f"{prompts}:3: {culprit}" in _the_error_line(capsys)


# -- checkpoints


def _no_tokens_prompt_file(tmp_path: Path) -> Path:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt_token_ids": [1, 2, 3]}\n')
    return prompts


def _safetensors_bytes(tmp_path: Path) -> bytes:
    return _write_weights(tmp_path / "good.safetensors").read_bytes()


@pytest.mark.parametrize(
    "content",
    [
        lambda good: b"hello, not safetensors\n",
        lambda good: b"",
        lambda good: good[:5],  # inside the header's length
        lambda good: good[:20],  # inside the header
        lambda good: good[: len(good) - 10],  # inside the tensors' bytes
        lambda good: good[:8] + b"{not json" + good[17:],
    ],
    ids=["text", "empty", "length cut", "header cut", "data cut", "header not json"],
)
def test_issue28_6_weights_not_safetensors_named(tmp_path, capsys, content) -> None:
    model = _model_dir(tmp_path, weights=False)
    weights = model / "model.safetensors"
    weights.write_bytes(content(_safetensors_bytes(tmp_path)))
    assert main(_generate(model, _no_tokens_prompt_file(tmp_path))) == 2
    assert f"{weights}: not a valid safetensors file" in _the_error_line(capsys)


def test_issue28_6_one_bad_shard_among_good_ones_is_named(tmp_path, capsys) -> None:
    model = _model_dir(tmp_path, weights=False)
    _write_weights(model / "model-00001-of-00002.safetensors")
    bad = model / "model-00002-of-00002.safetensors"
    bad.write_bytes(_safetensors_bytes(tmp_path)[:40])
    assert main(_generate(model, _no_tokens_prompt_file(tmp_path))) == 2
    assert f"{bad}: not a valid safetensors file" in _the_error_line(capsys)


def _gguf_file(path: Path, *, head_count: object = 2) -> Path:
    """A tiny llama GGUF file (metadata and two tensors; ``head_count`` None: left out)."""
    gguf = pytest.importorskip("gguf")
    import numpy as np

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    if head_count is not None:
        writer.add_uint32("llama.attention.head_count", head_count)
    writer.add_head_count_kv(1)
    writer.add_vocab_size(16)
    writer.add_eos_token_id(1)  # with no tokens: transformers' GGUF tokenizer once raised on it
    writer.add_tensor("token_embd.weight", np.ones((16, 8), dtype=np.float32))
    writer.add_tensor("output_norm.weight", np.ones(8, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_issue28_6_gguf_magic_invalid_names_the_file(tmp_path, capsys) -> None:
    good = _gguf_file(tmp_path / "good.gguf").read_bytes()
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"GGUX" + good[4:])
    assert main(_generate(bad, _no_tokens_prompt_file(tmp_path))) == 2
    line = _the_error_line(capsys)
    assert f"{bad}: not a valid GGUF file" in line


@pytest.mark.parametrize("keep", [0, 3, 4, 8, 16, 24, 60, 200, 0.5, 0.99, -1])
def test_issue28_6_gguf_truncated_names_the_file(tmp_path, capsys, keep) -> None:
    good = _gguf_file(tmp_path / "good.gguf").read_bytes()
    size = int(len(good) * keep) if isinstance(keep, float) else keep % len(good)
    bad = tmp_path / "model.gguf"
    bad.write_bytes(good[:size])
    assert main(_generate(bad, _no_tokens_prompt_file(tmp_path))) == 2
    line = _the_error_line(capsys)
    assert f"{bad}: not a valid GGUF file" in line
    assert "truncated" in line or size < 4  # an empty or 3-byte file is no GGUF at all


@pytest.mark.parametrize("head_count", [None, "two"], ids=["missing", "a string"])
def test_issue28_6_gguf_metadata_missing_or_wrong_names_the_file_and_key(
    tmp_path, capsys, head_count
) -> None:
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "model.gguf"
    if head_count is None:
        _gguf_file(path, head_count=None)
    else:  # the key with a string value
        writer = gguf.GGUFWriter(str(path), "llama")
        for key, value in (
            ("llama.block_count", 1),
            ("llama.embedding_length", 8),
            ("llama.feed_forward_length", 16),
            ("llama.vocab_size", 16),
        ):
            writer.add_uint32(key, value)
        writer.add_string("llama.attention.head_count", head_count)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    assert main(_generate(path, _no_tokens_prompt_file(tmp_path))) == 2
    line = _the_error_line(capsys)
    assert f"{path}: " in line and "llama.attention.head_count" in line


def test_issue28_6_gguf_without_a_tokenizer_says_so(tmp_path, capsys) -> None:
    path = _gguf_file(tmp_path / "model.gguf")
    argv = ["generate", "--model", str(path), "--prompt", "hi", "--max-tokens", "2"]
    assert main(argv) == 2
    line = _the_error_line(capsys)
    assert f"{path}: no tokenizer in its GGUF metadata" in line and "prompt_token_ids" in line


_LEFT_OUT = object()


def _with(**changes: object) -> dict:
    """LLAMA_CONFIG with ``changes`` (a field set to ``_LEFT_OUT`` is dropped)."""
    config = {**LLAMA_CONFIG, **changes}
    return {k: v for k, v in config.items() if v is not _LEFT_OUT}


@pytest.mark.parametrize(
    "config,culprit",
    [
        ("{nope", "not valid JSON"),
        ("", "not valid JSON"),
        ("[1]", "expected a JSON object"),
        ('"llama"', "expected a JSON object"),
        (_with(hidden_size=_LEFT_OUT), "missing field 'hidden_size'"),
        (_with(hidden_size="64"), "'hidden_size'"),
        (_with(hidden_size=64.5), "'hidden_size'"),
        (_with(hidden_size=64.0), "'hidden_size'"),
        (_with(hidden_size=True), "'hidden_size'"),
        (_with(hidden_size=None), "'hidden_size'"),
        (_with(hidden_size=[64]), "'hidden_size'"),
        (_with(num_attention_heads=0), "'num_attention_heads'"),
        (_with(num_hidden_layers=-1), "'num_hidden_layers'"),
        (_with(vocab_size=-3), "'vocab_size'"),
        (_with(vocab_size=10**30), "'vocab_size'"),
        (_with(num_hidden_layers=10**30), "'num_hidden_layers'"),
        (_with(head_dim=10**30), "'head_dim'"),
        (_with(hidden_size=66), "'hidden_size'"),  # no head_dim, and 4 heads do not divide it
        (_with(num_key_value_heads=3), "'num_key_value_heads'"),  # 4 query heads
        (_with(intermediate_size="wide"), "'intermediate_size'"),
        (_with(num_key_value_heads="2"), "'num_key_value_heads'"),
        (_with(head_dim="16"), "'head_dim'"),
        (_with(max_position_embeddings=2.5), "'max_position_embeddings'"),
        (_with(rms_norm_eps="a"), "'rms_norm_eps'"),
        (_with(rms_norm_eps=float("nan")), "'rms_norm_eps'"),
        (_with(rope_theta=float("inf")), "'rope_theta'"),
        (_with(rope_theta=-1.0), "'rope_theta'"),
        (_with(rope_scaling="x"), "'rope_scaling'"),
        (_with(rope_parameters=[1]), "'rope_parameters'"),
        (_with(rope_scaling={"rope_type": "linear", "factor": "4"}), "'factor'"),
        (_with(rope_scaling={"rope_type": 3}), "'rope_type'"),
        (_with(eos_token_id="x"), "'eos_token_id'"),
        (_with(eos_token_id=[1, "2"]), "'eos_token_id'"),
        (_with(eos_token_id=-1), "'eos_token_id'"),
        (_with(tie_word_embeddings="no"), "'tie_word_embeddings'"),
        (_with(attention_bias=1), "'attention_bias'"),
        (_with(layer_types=5), "'layer_types'"),
        (_with(layer_types=["full_attention", 7]), "'layer_types'"),
        (_with(sliding_window="big", model_type="mistral"), "'sliding_window'"),
        (_with(model_type=["llama"]), "'model_type'"),
    ],
)
def test_issue28_6_config_json_bad_names_the_file_and_field(tmp_path, capsys, config, culprit):
    model = _model_dir(tmp_path, config)
    assert main(_generate(model, _no_tokens_prompt_file(tmp_path))) == 2
    line = _the_error_line(capsys)
    assert f"{model / 'config.json'}: " in line and culprit in line


@pytest.mark.parametrize(
    "text,culprit",
    [
        ("{nope", "not valid JSON"),
        ("[2]", "expected a JSON object"),
        ('{"eos_token_id": "x"}', "'eos_token_id'"),
        ('{"eos_token_id": [2, 2.5]}', "'eos_token_id'"),
    ],
)
def test_issue28_6_generation_config_bad_names_the_file(tmp_path, capsys, text, culprit):
    model = _model_dir(tmp_path)
    (model / "generation_config.json").write_text(text)
    assert main(_generate(model, _no_tokens_prompt_file(tmp_path))) == 2
    line = _the_error_line(capsys)
    assert f"{model / 'generation_config.json'}: " in line and culprit in line


def test_issue28_6_no_weights_says_the_weights_are_missing(tmp_path, capsys) -> None:
    model = _model_dir(tmp_path, weights=False)
    argv = ["generate", "--model", str(model), "--prompt", "hi", "--max-tokens", "2"]
    assert main(argv) == 2
    line = _the_error_line(capsys)
    assert f"{model}: no *.safetensors file" in line and "tokenizer" not in line


def test_issue28_6_no_tokenizer_says_the_tokenizer_files_are_missing(tmp_path, capsys) -> None:
    model = _model_dir(tmp_path)
    argv = ["generate", "--model", str(model), "--prompt", "hi", "--max-tokens", "2"]
    assert main(argv) == 2
    line = _the_error_line(capsys)
    assert f"{model}: no tokenizer files" in line and "tokenizer.json" in line
    assert "prompt_token_ids" in line  # the way out


@pytest.mark.parametrize(
    "file,text,culprit",
    [
        ("tokenizer.json", "{nope", "Expecting property name"),
        ("tokenizer_config.json", "{nope", "tokenizer_config.json"),
    ],
    ids=["tokenizer not json", "tokenizer config not json"],
)
def test_issue28_6_a_tokenizer_that_cannot_load_says_why(
    tmp_path, capsys, chat_tokenizer_files, file, text, culprit
) -> None:
    model = _chat_model_dir(tmp_path, chat_tokenizer_files)
    (model / file).write_text(text)
    argv = ["generate", "--model", str(model), "--prompt", "w3", "--max-tokens", "2"]
    assert main(argv) == 2
    line = _the_error_line(capsys)
    assert f"{model}: its tokenizer" in line and "cannot be loaded" in line and culprit in line


@pytest.mark.parametrize("engine", ["local", "ray"])
def test_a_checkpoint_without_a_tensor_the_model_needs_names_it(
    tmp_path, capsys, chat_tokenizer_files, request, engine: str
) -> None:
    """Its config and tokenizer are whole (a config field raykv does not read is no fault:
    the tokenizer is built from its own files), its weights lack the embedding: refused before
    any rank loads them (a rank actor's failure would reach the user as Ray's traceback)."""
    if engine == "ray":
        request.getfixturevalue("ray_session")
        capsys.readouterr()  # what starting the session's Ray printed
    model = _chat_model_dir(tmp_path, chat_tokenizer_files)
    (model / "config.json").write_text(json.dumps({**LLAMA_CONFIG, "hidden_act": 5}))
    _write_weights(model / "model.safetensors", without="model.embed_tokens.weight")
    argv = ["generate", "--engine", engine, "--model", str(model), "--prompt", "w3"]
    argv += ["--max-tokens", "2"]
    assert main(argv) == 2
    line = _the_error_line(capsys)
    assert f"{model}: the checkpoint has no tensor 'model.embed_tokens.weight'" in line


def test_issue28_6_a_good_directory_still_configures(tmp_path, chat_tokenizer_files) -> None:
    """The checks refuse only what is broken: the same directory, whole, is read as before."""
    from raykv.model.checkpoint import configure
    from raykv.model.tokenizer import Tokenizer

    model = _chat_model_dir(tmp_path, chat_tokenizer_files)
    (model / "generation_config.json").write_text('{"eos_token_id": [1, 2]}')
    cfg, spec, path = configure(load_config(None, [f"model.path={model}"]))
    assert (spec.hidden_size, spec.num_layers, cfg.model.stop_token_ids) == (64, 2, [1, 2])
    tokenizer = Tokenizer.of(path)
    assert tokenizer is not None and tokenizer.chat([{"role": "w2", "content": "w3"}])


def test_issue28_10_the_kv_router_without_kv_events_is_refused_naming_the_key(capsys) -> None:
    assert main(["serve", "--replicas", "2", "--set", "offload.events=false"]) == 2
    err = capsys.readouterr().err
    assert "offload.events" in err and "--router pow2" in err and len(err.splitlines()) == 1
    from raykv.serve.app import ServeOptions, check_router

    quiet = load_config(None, ["offload.events=false"])
    check_router(quiet, ServeOptions(replicas=2, router="pow2"))  # nothing to follow: fine
    check_router(quiet, ServeOptions(replicas=1))  # one replica routes by pow2
    check_router(load_config(None, []), ServeOptions(replicas=2))


def test_issue28_9_a_max_positions_override_keeps_a_tighter_context_and_warns_past_it(
    tmp_path, caplog
) -> None:
    pytest.importorskip("transformers")
    from raykv.model.checkpoint import configure
    from tests.model.test_decoder import checkpoint

    path, model = checkpoint(tmp_path, "llama-tied")
    trained = model.config.max_position_embeddings
    for asked, served, warns in ((None, trained, False), (16, 16, False), (10**6, trained, True)):
        caplog.clear()
        sets = [f"model.path={path}"] + ([f"model.max_positions={asked}"] if asked else [])
        cfg, _, _ = configure(load_config(None, sets))
        assert cfg.model.max_positions == served
        warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert bool(warned) == warns and all("model.max_positions" in m for m in warned)


@pytest.mark.parametrize("engine", ["local", "ray"])
def test_a_disk_path_that_fails_only_where_the_ranks_run_is_named_in_one_line(
    tmp_path, capsys, request, engine: str
) -> None:
    """The path passes the check (its parent is a writable directory) but the namespace's
    directory cannot be made under it (a file holds its name): the Ray engine gave exit 1 and a
    159-line traceback (a rank actor's failed creation), the local one a message without the
    key."""
    from raykv.engine.tier_namespace import namespace

    if engine == "ray":
        request.getfixturevalue("ray_session")
        capsys.readouterr()
    sets = [
        "offload.disk.enabled=true",
        f"offload.disk.path={tmp_path}",
        "offload.disk.capacity=64MiB",
    ]
    (tmp_path / namespace(load_config("configs/synthetic.yaml", sets))).write_text("in the way")
    argv = ["run", "--engine", engine, "--config", "configs/synthetic.yaml", "--num-requests", "2"]
    for s in sets:
        argv += ["--set", s]
    assert main(argv) == 2
    line = _the_error_line(capsys)
    assert line.startswith("raykv: error: offload.disk.path:") and str(tmp_path) in line


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("dangling", "is a link to"),
        ("/proc/raykv-tier", "cannot make a directory in '/proc'"),
        ("~no-such-user-here/tier", "no such user's home directory"),
    ],
)
def test_a_disk_path_no_rank_could_use_is_refused_by_the_check(
    tmp_path, capsys, value: str, why: str
) -> None:
    """``raykv config check`` took a dangling link for a missing directory and ``/proc/...``
    for a writable one (root passes every permission bit); ``~nouser/x`` made a directory
    named ``~nouser`` in the working directory."""
    if value == "dangling":
        value = str(tmp_path / "tier")
        os.symlink(tmp_path / "gone" / "away", value)
    argv = ["config", "check", "configs/synthetic.yaml", "--set", "offload.disk.enabled=true"]
    assert main([*argv, "--set", f"offload.disk.path={value}"]) == 2
    line = _the_error_line(capsys)
    assert "offload.disk" in line and why in line
    assert not os.path.exists("~no-such-user-here")


def test_a_server_that_is_no_mooncake_master_is_named_as_such(capsys) -> None:
    """An HTTP server on loopback as ``offload.shared.master``: 30 s despite ``timeout_s=5``, a
    dozen glog lines, and "no segment given"; now one line saying no master answers there."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Quiet(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

    pytest.importorskip("mooncake.store")
    server = ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        address = f"127.0.0.1:{server.server_address[1]}"
        argv = ["run", "--engine", "local", "--config", "configs/synthetic.yaml"]
        argv += ["--num-requests", "2", "--set", "offload.shared.enabled=true"]
        argv += ["--set", f"offload.shared.master={address}", "--set", "offload.shared.timeout_s=1"]
        assert main(argv) == 2
    finally:
        server.shutdown()
        server.server_close()
    line = _the_error_line(capsys)
    assert "offload.shared.master" in line and f"no Mooncake master at {address}" in line
