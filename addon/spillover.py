"""mitmproxy addon: keep a streaming answer alive when its server runs out of memory.

    mitmdump -s addon/spillover.py --mode reverse:http://127.0.0.1:8081@8090 \\
        --set spillover_fallbacks=http://127.0.0.1:8082

Streaming chat completions are spliced: they stream from the primary until a handoff
is asked for (memory pressure seen by the watcher, `spillover.handoff`, POST
/spillover/handoff) or the primary fails, then continue on the next fallback in the
same client response.
Everything else passes through mitmproxy untouched.
"""

import sys
from pathlib import Path

if __package__ != "addon":  # loaded by `mitmdump -s` as a script file
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from addon.surface.connlog import ConnectionLog
from addon.surface.proxy import Spillover
from addon.surface.redirect import KernelRedirect
from addon.surface.sseview import register as register_sseview
from addon.surface.watch import MemoryWatch

register_sseview()
spillover = Spillover()
addons = [spillover, MemoryWatch(spillover), KernelRedirect(), ConnectionLog()]
