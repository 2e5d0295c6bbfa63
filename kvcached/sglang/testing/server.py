"""A real SGLang HTTP server for the end-to-end tests, driven like the vLLM ones (tests only).

``SglangServer`` runs ``python -m sglang.launch_server`` (SGLang 0.5.23, from ``.venv-sglang``)
as a process group of its own on 127.0.0.1, and speaks to it through the same client as the vLLM
``Server`` it extends (``kvcached.vllm.testing.e2e``): SGLang serves OpenAI's ``/v1/completions``
with greedy decoding and top-5 logprobs as vLLM does, and ``/flush_cache`` is its prefix-cache
reset. It is started from another environment (the vLLM CPU build's, in a test that runs a vLLM
engine beside it), so nothing here imports SGLang: the CPU platform's small distribution
(``cpu_platform.dist_info``) is written by the SGLang interpreter itself. Flags as in
``serve.py``: CPU, ``torch_native`` attention, page_size 1, HiCache with direct copies; the
device pool holds ``kv_cache_bytes`` of KV (``--max-total-tokens``, from the model's shapes).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

from kvcached.vllm.testing.e2e import Server, ServerConfig

ROOT = Path(__file__).resolve().parents[3]
# The interpreter of SGLang's environment (scripts/_env.sh, ensure_sglang_env).
DEFAULT_PYTHON = ROOT / ".venv-sglang" / "bin" / "python"


def kv_bytes_per_token(model: str | Path) -> int:
    """Bytes of K and V one token takes in every layer of ``model`` (bf16), as SGLang's MHA pool lays them out."""
    cfg = json.loads((Path(model) / "config.json").read_text())
    heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return int(cfg["num_hidden_layers"]) * 2 * int(heads) * int(head_dim) * 2


class SglangServer(Server):
    """One SGLang HTTP server process group; ``python`` is SGLang's interpreter."""

    def __init__(self, config: ServerConfig, log_path: str | Path, *, python: str | Path = DEFAULT_PYTHON) -> None:
        super().__init__(config, log_path, python=str(python))
        self.site = self.log_path.parent / f"{self.log_path.stem}-site"

    def argv(self) -> list[str]:
        c = self.config
        args = [
            self.python, "-m", "sglang.launch_server",
            "--model-path", c.model,
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--page-size", "1",
            "--context-length", str(c.max_model_len),
            "--random-seed", "0",
            "--enable-cache-report",
        ]  # fmt: skip
        if c.on_cpu:
            args += ["--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph"]
            args += ["--grammar-backend", "none"]
        if c.kv_cache_bytes is not None:
            args += ["--max-total-tokens", str(c.kv_cache_bytes // kv_bytes_per_token(c.model))]
        if c.cpu_offload_bytes:
            hicache = ("--hicache-io-backend", "direct", "--hicache-mem-layout", "layer_first")
            args += ["--enable-hierarchical-cache", *hicache]
        return args + list(c.extra_args)

    def environment(self) -> dict[str, str]:
        drop = ("KVCACHED_", "ENABLE_KVCACHED", "SGLANG_", "VLLM_")
        env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
        env.update(HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
        if self.config.on_cpu:  # SGLang's CPU platform (cpu_platform.dist_info)
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(self.site), env.get("PYTHONPATH")]))
        env["ENABLE_KVCACHED"] = "1" if self.config.kvcached else "0"
        env.update(self.config.env)
        return env

    def start(self) -> SglangServer:
        if self.config.on_cpu and not self.site.exists():
            code = f"from kvcached.sglang.testing import cpu_platform; cpu_platform.dist_info({str(self.site)!r})"
            subprocess.run([self.python, "-c", code], check=True, capture_output=True, timeout=300)
        super().start()
        return self

    def worker_pid(self) -> int:
        """The scheduler process, which holds the KV pool (SGLang titles it ``sglang::scheduler``)."""
        import psutil

        for pid, p in self._processes().items():
            with contextlib.suppress(psutil.Error):
                if p.name().startswith("sglang::scheduler") or "sglang::scheduler" in " ".join(p.cmdline()):
                    return pid
        raise RuntimeError("no SGLang scheduler process found under the server")

    def reset_prefix_cache(self) -> bool:
        """``POST /flush_cache``: SGLang answers in plain text, 200 once both tiers are empty
        (400 while requests run: ``Scheduler.flush_cache`` refuses unless fully idle)."""
        req = urllib.request.Request(self.url + "/flush_cache", data=b"", method="POST")
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return bool(r.status == 200)
        except urllib.error.HTTPError:
            return False
