"""`make bench`: everything measured side by side in one run.

    python -m bench                 # all parts: prompt, model, layers
    python -m bench prompt          # render + tokenize a Claude-Code-sized request
    python -m bench model           # prefill / decode tokens/s vs transformers, state bytes
    python -m bench layers          # where ds4jax's time goes inside one chunk
    python -m bench --quick         # prompt + model at small sizes: a smoke run (< 2 min)

`python -m bench model --help` lists the model part's own options.
"""

from __future__ import annotations

import sys
import time

PARTS = ("prompt", "model", "layers")

#: `make bench` must end within 20 minutes on 2 shared cores: the model part caps itself
#: (`--budget-min`, 12 by default) and the layer breakdown starts no case after this.
LAYERS_DEADLINE_MIN = 16.5


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    rest = [a for a in argv if a not in PARTS]
    quick = "--quick" in rest
    # the layer breakdown is a profile, not a smoke test: --quick runs it only when named
    parts = [a for a in argv if a in PARTS] or [p for p in PARTS if not quick or p != "layers"]
    t0 = time.perf_counter()
    for part in parts:
        print(f"\n=== bench {part} ===", flush=True)
        if part == "prompt":
            from bench import prompt

            prompt.main(quick=quick)
        elif part == "model":
            from bench import model

            model.main(rest)
        else:
            from bench import layers

            layers.main(rest, deadline=t0 + 60 * LAYERS_DEADLINE_MIN)
    print(f"\nbench total {time.perf_counter() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
