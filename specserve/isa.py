"""What this CPU can really run, found by trying, not by its flags.

Some VMs advertise AMX in /proc/cpuinfo without enabling it: oneDNN then picks AMX for any
bfloat16 matmul and the process dies with SIGILL (no Python exception, nothing printed). On a
CPU that advertises AMX, a bfloat16 matmul is tried once in a child process; if it dies, then
once more with oneDNN capped at AVX512_CORE_BF16, and the cap that works is set in this process's
environment before oneDNN starts. The outcome is cached per CPU and PyTorch version, so only the
first run on a machine pays for the probe. No module here imports torch at import time: the cap
must be in place before torch initializes oneDNN.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

logger = logging.getLogger("specserve")

ISA_ENV = "ONEDNN_MAX_CPU_ISA"
AMX_FLAGS = frozenset({"amx_bf16", "amx_tile", "amx_int8"})
CAPS = ("AVX512_CORE_BF16", "AVX512_CORE", "AVX2")
_PROBE = "import torch; a = torch.ones(64, 64, dtype=torch.bfloat16); float((a @ a).sum())"


def cache_root() -> Path:
    """Where specserve keeps what it computes once per machine ($SPECSERVE_CACHE, else
    ~/.cache/specserve): kernel choices, converted GGUF tokenizers, this probe's outcome."""
    base = os.environ.get("SPECSERVE_CACHE")
    return Path(base) if base else Path.home() / ".cache" / "specserve"


def read_kept(path: Path) -> dict[str, Any]:
    """The JSON object kept at `path` (a file under cache_root()), or {} where it is missing,
    unreadable or not an object."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def keep(path: Path, entries: dict[str, Any]) -> None:
    """`entries` added to the JSON object at `path`, merged with what the file holds now (another
    process may have added to it since this one read it), written whole and swapped in at once.
    Raises OSError where it cannot be written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({**read_kept(path), **entries}, indent=1, sort_keys=True))
    os.replace(tmp, path)


def cpu_info() -> tuple[str, frozenset[str]]:
    """This CPU's model name and flags, as /proc/cpuinfo reports them (empty where it cannot be read)."""
    model, flags = "", frozenset()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and not model:
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return model, flags


def _torch_version() -> str:
    try:
        from importlib.metadata import version

        return version("torch")
    except Exception:  # noqa: BLE001
        return "unknown"


def _probe(env_cap: str | None) -> int:
    env = {**os.environ}
    if env_cap is not None:
        env[ISA_ENV] = env_cap
    try:
        return subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, timeout=120).returncode
    except (OSError, subprocess.SubprocessError):
        return 1


def safe_isa_cap(cache_dir: Path | None = None) -> str | None:
    """The oneDNN ISA cap this machine needs for bfloat16 matmuls to run (None: none needed, or
    nothing helps: then `bf16_works()` is False). Probes only where AMX is advertised."""
    model, flags = cpu_info()
    if not (flags & AMX_FLAGS):
        return None
    cache_dir = cache_dir or cache_root()
    key = hashlib.sha256(f"{model}|{' '.join(sorted(flags))}|{_torch_version()}".encode()).hexdigest()[:16]
    path = cache_dir / "isa-probe.json"
    value = read_kept(path).get(key)
    if value is None:
        value = "none"
        if _probe(None) == -signal.SIGILL:
            value = next((cap for cap in CAPS if _probe(cap) == 0), "broken")
        try:
            keep(path, {key: value})
        except OSError:
            pass
    return None if value == "none" else value


def apply_isa_cap() -> str | None:
    """Set the cap in this process (unless the user set one). Call before torch is imported."""
    if ISA_ENV in os.environ:
        return os.environ[ISA_ENV]
    cap = safe_isa_cap()
    if cap is not None and cap != "broken":
        os.environ[ISA_ENV] = cap
        logger.info("this CPU advertises AMX that does not run: oneDNN capped at %s", cap)
    return cap


def bf16_works() -> bool:
    """Whether bfloat16 matmuls run in this process's configuration."""
    return os.environ.get(ISA_ENV) != "broken" and safe_isa_cap() != "broken"
