"""The executor's command line reaches its engine configuration."""

from __future__ import annotations

from pathlib import Path

import pytest

from l4m.executor.__main__ import parse_config
from l4m.wire.credentials import write_secret_file


def test_decode_kernel_is_on_by_default_and_can_be_turned_off() -> None:
    assert parse_config(["--model", "m.gguf"])[0].engine.decode_kernel is True
    assert parse_config(["--model", "m.gguf", "--decode-kernel", "off"])[0].engine.decode_kernel is False


def test_a_bad_decode_kernel_value_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        parse_config(["--decode-kernel", "maybe"])
    assert exit_.value.code == 2
    assert "--decode-kernel" in capsys.readouterr().err


def test_decode_graphs_flags_reach_the_config(capsys: pytest.CaptureFixture[str]) -> None:
    engine = parse_config(["--model", "m.gguf"])[0].engine
    assert engine.decode_graphs is True and engine.graph_max_batch == 64
    assert engine.capture_graphs_at_start is True  # a serving executor captures before it takes traffic
    lazy = parse_config(["--model", "m.gguf", "--graph-capture", "first-use"])[0].engine
    assert lazy.capture_graphs_at_start is False
    engine = parse_config(["--model", "m.gguf", "--decode-graphs", "off", "--graph-max-batch", "16"])[0].engine
    assert engine.decode_graphs is False and engine.graph_max_batch == 16
    with pytest.raises(SystemExit) as exit_:
        parse_config(["--model", "m.gguf", "--graph-max-batch", "0"])
    assert exit_.value.code == 2
    assert "--graph-max-batch must be at least 1, got 0" in capsys.readouterr().err


def test_the_cluster_secret_and_tls_reach_the_config(tmp_path: Path) -> None:
    secret_file = tmp_path / "cluster.secret"
    secret = write_secret_file(secret_file)
    config = parse_config(["--model", "m.gguf", "--cluster-secret-file", str(secret_file), "--tls-cert", "c.pem",
                           "--tls-key", "k.pem"])[0]
    assert config.cluster_secret == secret and config.tls is not None and config.tls.key_path == Path("k.pem")
    assert parse_config(["--model", "m.gguf"])[0].cluster_secret == ""


def test_an_unreadable_secret_file_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_config(["--model", "m.gguf", "--cluster-secret-file", str(tmp_path / "missing")])
    assert "cannot read the secret file" in capsys.readouterr().err


def test_a_model_the_executor_does_not_implement_exits_with_its_reason(tmp_path: Path, capsys) -> None:
    """Refused at load, before anything listens: exit status 2 and the field named, no traceback."""
    import json

    from l4m.executor.__main__ import main

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Gemma2ForCausalLM"]}))
    with pytest.raises(SystemExit) as exit_:
        main(["--model", str(tmp_path), "--listen", f"unix:{tmp_path}/executor.sock"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"cannot serve {tmp_path}: architecture 'Gemma2ForCausalLM' is not implemented" in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("preset", "expected"),
    [
        ({}, "policy=- spincount=1000"),
        ({"OMP_WAIT_POLICY": "PASSIVE"}, "policy=PASSIVE spincount=-"),
        ({"GOMP_SPINCOUNT": "500"}, "policy=- spincount=500"),
    ],
)
def test_openmp_threads_spin_a_little_while_waiting_unless_the_operator_chose(preset: dict, expected: str) -> None:
    """Set before torch loads (libgomp reads it once): a fresh interpreter that imports the executor's main."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")} | preset
    # torch is not loaded before the main module sets the policy (the package imports nothing of it).
    probe = ("import sys, os; import l4m.executor; before = 'torch' in sys.modules; import l4m.executor.__main__; "
             "get = lambda k: os.environ.get(k, '-'); "
             "print(f\"policy={get('OMP_WAIT_POLICY')} spincount={get('GOMP_SPINCOUNT')}\", before, 'torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [*expected.split(), "False", "True"]


def test_an_unknown_cpu_isa_is_refused_before_anything_loads(monkeypatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("L4M_CPU_ISA", "avx-512")
    with pytest.raises(SystemExit) as exit_:
        parse_config(["--model", "m.gguf"])
    assert exit_.value.code == 2
    assert "L4M_CPU_ISA must be one of auto, avx2, avx512, avx512_bf16, amx, got 'avx-512'" in capsys.readouterr().err
    assert parse_config(["--model", "m.gguf", "--device", "cuda:0"])[0].engine.device == "cuda:0"  # no CPU kernels


# The operator's precision opt-ins: (flag, EngineConfig field, default, the opt-in, a value it refuses).
PRECISION_FLAGS = pytest.mark.parametrize(
    ("flag", "field", "default", "chosen", "bad"),
    [("--quantized-activations", "quantized_activations", "float32", "bfloat16", "int8"),
     ("--kv-cache-dtype", "kv_cache_dtype", "auto", "float16", "fp8")],
    ids=["x-in-bf16", "float16-kv-cache"],
)


@PRECISION_FLAGS
def test_a_precision_opt_in_is_the_operators_flag_and_off_by_default(
    capsys: pytest.CaptureFixture[str], flag: str, field: str, default: str, chosen: str, bad: str
) -> None:
    assert getattr(parse_config(["--model", "m.gguf"])[0].engine, field) == default
    assert getattr(parse_config(["--model", "m.gguf", flag, chosen])[0].engine, field) == chosen
    with pytest.raises(SystemExit) as exit_:
        parse_config(["--model", "m.gguf", flag, bad])
    assert exit_.value.code == 2
    assert f"{flag}: invalid choice: '{bad}'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "reason"),
    [(["--weights", "dequantized", "--quantized-activations", "bfloat16"],
      "l4m executor: quantized_activations=bfloat16 needs quantized weights"),
     (["--dtype", "bfloat16", "--kv-cache-dtype", "float16"],
      "l4m executor: kv_cache_dtype=float16 is implemented for device cpu with dtype float32")],
    ids=["x-in-bf16-on-dense-weights", "float16-kv-cache-in-bfloat16"],
)
def test_a_precision_opt_in_that_cannot_run_exits_with_its_reason_before_listening(
    tmp_path: Path, capsys, argv: list[str], reason: str
) -> None:
    """The engine refuses the combination: exit status 2, the reason, no socket, no traceback."""
    from l4m.executor.__main__ import main

    socket = tmp_path / "executor.sock"
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--listen", f"unix:{socket}"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert reason in err
    assert "Traceback" not in err
    assert not socket.exists()
