"""Benchmark: vLLM behind the addon, and handoffs across the engine boundary, in one run.

A real vLLM (its CPU build, on an HF copy of the tiny fallback model) answers chat
completions direct, through plain mitmdump and through the addon (medians, routes
interleaved, as scripts/bench/apis.py does for llama-server); then the pause a client
sees at a handoff asked for at its 20th text event, llama-server -> vLLM and
vLLM -> llama-server, next to the longest gap of the same answer with no handoff (vLLM's
CPU build on 2 cores writes in bursts: ../shared/FACTS.md section 6).

    .venv/bin/python -m scripts.bench.engines [--quick]
"""

from __future__ import annotations

import json

import httpx

from scripts.bench.apis import command_line, pause, side_by_side, timed
from scripts.parts.processes import running
from scripts.testbed.llamaserver import LlamaServer
from scripts.testbed.mitm import Mitmdump
from scripts.testbed.tinymodels import ensure_models
from scripts.testbed.vllmserver import SERVED_NAME, VllmServer, hf_copy

NAMED = {"model": SERVED_NAME}


def main() -> None:
    repeats, tokens, work = command_line(__doc__, "engines")
    models = ensure_models(work / "models")
    vllm = VllmServer(hf_copy(models["fallback"]))
    vllm.log_path = work / "vllm.log"
    llama = LlamaServer(models["fallback"], log_dir=work)
    with running(llama):
        vllm.start(timeout=300)
        try:
            plain = Mitmdump(vllm.url, addon=False, log_dir=work)
            to_llama = Mitmdump(vllm.url, [llama.url], log_dir=work)
            to_vllm = Mitmdump(llama.url, [vllm.url], log_dir=work)
            with running(plain, to_llama, to_vllm):
                to_llama.servers_known()
                to_vllm.servers_known()
                urls = {"direct": vllm.url, "plain mitmdump": plain.url, "addon": to_llama.url}
                print(f"{repeats} answers of {tokens} tokens per row, medians")
                print(f"{'engine':10}{'route':16}{'first ms':>12}{'over direct':>12}"
                      f"{'whole ms':>12}{'ratio':>12}")  # fmt: skip
                side_by_side("chat", urls, repeats, tokens, extra=NAMED, label="vLLM")
                pauses = {}
                for name, proxy, server in (
                    ("llama-server -> vLLM", to_vllm, llama),
                    ("vLLM -> llama-server", to_llama, vllm),
                ):
                    _, _, gaps = timed(httpx.Client(), server.url, "chat", 600, extra=NAMED)
                    pauses[name] = {
                        "handoff pause": round(pause("chat", proxy, 600, extra=NAMED), 1),
                        "longest gap without one": round(max(gaps[19:]), 1),
                    }
        finally:
            vllm.stop()
    print("\nhandoff pause a client sees (gap around the cut), ms")
    print(json.dumps(pauses, indent=1))


if __name__ == "__main__":
    main()
