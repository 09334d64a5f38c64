"""`make bench`: everything measured side by side in one run, results in bench/results/.

    python -m bench                 # all parts but layers (< 20 min on 2 cores)
    python -m bench prompt          # render + tokenize a Claude-Code-sized request
    python -m bench model           # prefill / decode tokens/s vs transformers, state bytes
    python -m bench continuation    # TTFT of a tool-result turn by path vs history length
    python -m bench disk            # disk save/restore vs raw I/O; restore+suffix vs cold
    python -m bench kernels         # Pallas kernels vs jnp twins (interpreted on CPU)
    python -m bench layers          # where ds4jax's time goes inside one chunk
    python -m bench --quick         # small sizes: a smoke run

`python -m bench model --help` lists the model part's own options.
"""

from __future__ import annotations

import sys
import time

PARTS = ("prompt", "model", "continuation", "disk", "kernels", "layers")

#: `make bench` must end within 20 minutes on 2 cores: the model part caps itself
#: (`--budget-min`) and the layer breakdown starts no case after this.
LAYERS_DEADLINE_MIN = 18.0


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    rest = [a for a in argv if a not in PARTS]
    quick = "--quick" in rest
    # the layer breakdown is a profile, not a figure: it runs only when named
    parts = [a for a in argv if a in PARTS] or [p for p in PARTS if p != "layers"]
    if "--budget-min" not in rest and len(parts) > 1:
        # leave the other parts ~8 minutes of the 20-minute `make bench` allowance
        rest += ["--budget-min", "9"]
    t0 = time.perf_counter()
    for part in parts:
        print(f"\n=== bench {part} ===", flush=True)
        if part == "prompt":
            from bench import prompt

            prompt.main(quick=quick)
        elif part == "model":
            from bench import model

            model.main(rest)
        elif part == "continuation":
            from bench import continuation

            continuation.main(quick=quick)
        elif part == "disk":
            from bench import disk

            disk.main(quick=quick)
        elif part == "kernels":
            from bench import kernels

            kernels.main(quick=quick)
        else:
            from bench import layers

            layers.main(rest, deadline=t0 + 60 * LAYERS_DEADLINE_MIN)
    print(f"\nbench total {time.perf_counter() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
