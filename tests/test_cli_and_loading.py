"""The command line works end to end; dummy weights and the GGUF cache behave as documented."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


from specserve import LLM, SamplingParams

from conftest import random_prompts

REPO = Path(__file__).resolve().parents[1]


def run_cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    """Run `specserve ...`; stdout/stderr decoded as UTF-8 without newline translation."""
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    res = subprocess.run(
        [sys.executable, "-m", "specserve.cli", *args],
        input=None if stdin is None else stdin.encode(), capture_output=True, timeout=300, cwd=REPO, env=env,
    )
    res.stdout = res.stdout.decode("utf-8")
    res.stderr = res.stderr.decode("utf-8")
    return res


def test_generate_streams_text(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama))
    expected = llm.generate("hello", SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
                            use_tqdm=False)[0].text
    res = run_cli("generate", "hello", "--model", str(tiny_llama), "--max-tokens", "12", "--ignore-eos")
    assert res.returncode == 0, res.stderr
    assert res.stdout == expected + "\n"
    assert "12 tokens" in res.stderr and "finish_reason=length" in res.stderr


def test_chat_repl_keeps_history(tiny_llama: Path) -> None:
    """Each reply is generated from the whole conversation so far, and /reset forgets it: the
    second turn's reply equals what the model says to the full two-turn chat, not to the lone
    message, and after /reset the first message gets its first reply again."""
    opts = ("--model", str(tiny_llama), "--max-tokens", "6", "--stop", "\n")  # one line per reply
    res = run_cli("chat", *opts, stdin="hi\nagain\n/reset\nhi\n/exit\n")
    assert res.returncode == 0, res.stderr
    replies = res.stdout.split("\n")
    llm = LLM(str(tiny_llama))
    params = SamplingParams(max_tokens=6, temperature=0, stop=["\n"])
    first = llm.chat([{"role": "user", "content": "hi"}], params, use_tqdm=False)[0].text
    with_history = llm.chat([{"role": "user", "content": "hi"}, {"role": "assistant", "content": first},
                             {"role": "user", "content": "again"}], params, use_tqdm=False)[0].text
    alone = llm.chat([{"role": "user", "content": "again"}], params, use_tqdm=False)[0].text
    assert replies[:3] == [first, with_history, first]
    assert with_history != alone, "pick other messages: these two contexts give the same reply"


def test_cli_errors_name_the_field(tiny_llama: Path) -> None:
    res = run_cli("generate", "hi", "--model", str(tiny_llama), "--temperature", "-1")
    assert res.returncode == 2 and "temperature:" in res.stderr
    res = run_cli("generate", "hi", "--model", "nope-model")
    assert res.returncode == 2 and "model:" in res.stderr


def test_dummy_weights_from_a_model_dir(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), load_format="dummy")
    out = llm.generate(random_prompts(1)[0], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.token_ids) == 4


def test_dummy_named_shape_runs() -> None:
    llm = LLM("smollm2-135m", load_format="dummy", max_model_len=256)
    assert llm.engine.model.config.num_layers == 30
    out = llm.generate([5, 6, 7], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.token_ids) == 3


def test_gguf_is_converted_once_and_reused(bundled_model_dir: Path) -> None:
    from specserve.model.loader import convert_gguf, find_bundled_gguf

    stamp = (bundled_model_dir / "model.safetensors").stat().st_mtime_ns
    assert convert_gguf(find_bundled_gguf("smollm2-135m")) == bundled_model_dir
    assert (bundled_model_dir / "model.safetensors").stat().st_mtime_ns == stamp  # not rewritten
    assert (bundled_model_dir / "tokenizer.json").is_file()


def test_engine_args_name_bad_options(tiny_llama: Path) -> None:
    """One definition of the engine options: unknown names and bad values are errors naming the
    option, for LLM(...) as on the command line."""
    from specserve.entrypoints.engine_args import EngineArgs

    with pytest.raises(TypeError, match="unknown option.*no_such_option"):
        LLM(str(tiny_llama), no_such_option=1)
    for kwargs, field in ((dict(quantization="int3"), "quantization"), (dict(attention_backend="flash"),
                          "attention_backend"), (dict(kv_cache_gb=0), "kv_cache_gb"), (dict(threads=0), "threads")):
        with pytest.raises(ValueError, match=field):
            EngineArgs(model=str(tiny_llama), **kwargs)


def test_the_command_line_and_llm_share_engine_args() -> None:
    """Every engine option of generate is an option of serve and of the benches, with the same default;
    that default is EngineArgs' own but for speculation, which the command line turns on (`auto`,
    with a draft model found among the user's GGUF files: `draft_model="auto"`) and LLM(...) leaves
    off. `--draft-model none` is no draft model."""
    from specserve.cli import build_parser
    from specserve.entrypoints.engine_args import CLI_DRAFT_DEFAULT, CLI_SPEC_DEFAULT, EngineArgs

    assert CLI_SPEC_DEFAULT == "auto" and CLI_DRAFT_DEFAULT == "auto" and EngineArgs().speculative.method == "none"
    parser = build_parser()
    for argv in (["generate", "x"], ["chat"], ["serve"], ["bench", "throughput"], ["bench", "spec"]):
        args = EngineArgs.from_cli(parser.parse_args(argv))
        assert args == EngineArgs(speculative=dict(method="auto", draft_model="auto"))
        assert EngineArgs.from_cli(parser.parse_args([*argv, "--draft-model", "none"])) == EngineArgs(speculative="auto")
        assert EngineArgs.from_cli(parser.parse_args([*argv, "--spec", "none"])) == EngineArgs()


def test_auto_quantization_follows_what_was_shipped(tiny_llama: Path) -> None:
    from specserve.model.loader import resolve_quantization

    assert resolve_quantization("auto", None) == "none"  # a Hugging Face directory: its float dtype
    assert resolve_quantization("int8", None) == "int8"


def test_auto_quantization_of_the_bundled_gguf_keeps_its_blocks(bundled_model_dir: Path) -> None:
    from specserve.model.loader import find_bundled_gguf, resolve_quantization

    assert resolve_quantization("auto", find_bundled_gguf("smollm2-135m")) == "gguf"
    assert resolve_quantization("auto", find_bundled_gguf("smollm2-135m"), "cuda") == "none"


def test_a_repo_id_is_found_in_the_hub_cache_and_named_when_it_is_not(
    tmp_path: Path, tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--model org/name: a Hugging Face repo (downloaded where there is a network; here the tests
    run offline, so the Hub's cache is all there is): a repo of Hugging Face files is its snapshot
    directory, a repo of GGUFs one file chosen by org/name:TAG; a repo that is nowhere is an error
    naming it and saying how to get it."""
    import shutil

    from specserve.model.loader import ModelNotFoundError, resolve_model_path

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def cached(repo: str) -> Path:
        root = tmp_path / ("models--" + repo.replace("/", "--"))
        (root / "refs").mkdir(parents=True)
        (root / "refs" / "main").write_text("abc123")
        snap = root / "snapshots" / "abc123"
        snap.mkdir(parents=True)
        return snap

    hf = cached("org/tiny")
    for f in tiny_llama.iterdir():
        shutil.copy(f, hf / f.name)
    ggufs = cached("org/tiny-gguf")
    for name in ("tiny-Q4_K_M.gguf", "tiny-Q8_0.gguf"):
        (ggufs / name).write_bytes(b"GGUF")
    assert resolve_model_path("org/tiny") == hf
    assert resolve_model_path("org/tiny-gguf:q4_k_m") == ggufs / "tiny-Q4_K_M.gguf"
    with pytest.raises(ModelNotFoundError, match=r"2 matching \.gguf files .*name one with org/tiny-gguf:TAG"):
        resolve_model_path("org/tiny-gguf")
    with pytest.raises(ModelNotFoundError, match=r"'nobody/nothing' is not a local path.*huggingface-cli download"):
        resolve_model_path("nobody/nothing")
    llm = LLM("org/tiny")
    assert len(llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)[0].token_ids) == 3
