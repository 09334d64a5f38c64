"""llama.cpp beside ds4jax in `make bench` (issue 17): the same random checkpoint, side by
side in one run, on the same cores.

* **Build.** The llama.cpp vendored in the PyPI `llama-cpp-python` sdist (`LLAMA_VERSION`,
  which has the `deepseek4` arch), CMake Release with native CPU flags, `-j 2`, under
  `~/.cache/ds4jax/llama.cpp/` — only the first bench pays the build (minutes). Beside
  `llama-bench` it builds `bench/llamacpp/dump_logits.c`, our own small program that writes
  llama.cpp's logits at every prompt position. If any step fails (no network for the sdist,
  no compiler) the part says why and returns; the other parts still run.
* **Checkpoint.** `bench-192m`'s random weights written in the official release layout
  (FP8 linears, FP4 routed experts; `write_official_checkpoint`), as the release ships.
  ds4jax loads it with `load_model` (everything dequantized to f32). llama.cpp converts it
  with its own `convert_hf_to_gguf.py --outtype f32`, which keeps the experts in MXFP4 and
  stores the FP8 linears as Q8_0 ("as converted"), and runs a copy of that GGUF with every
  tensor dequantized to F32 ("all F32"): as many weight bytes per token as ds4jax reads.
* **Logits.** Both engines on the same 64 prompt tokens: the cosine similarity of their
  next-token logits at every position (the minimum is reported; the bar is 0.9999). llama.cpp
  does not simulate the FP8 KV / FP4 indexer rounding, so the bar applies to ds4jax with
  `quant_sim` off; the on figure is reported beside it.
* **Speed.** `llama-bench -t 2 -p 512,2048,8192 -n 32 -r 2` on each GGUF (its `tg32`
  decodes from an empty cache) and `-p 0 -n 32 -d 8192` (the same after 8,192 tokens), and
  ds4jax's prefill of the same lengths and 32 greedy steps of the server's batched step at
  size 1 after one token and after the 8,192-token prefill (`quant_sim` off: the same
  math), twice: all f32 (beside "all F32") and with
  `--weights fp4-experts` (the routed experts resident in the release's FP4, two codes per
  byte, the rest f32: beside "as converted", as many weight bits per token). The summary
  gains ds4jax / llama.cpp for each prefill size and for decode, each pair like for like
  (`OURS`).
* **Rounds.** The whole speed comparison runs `ROUNDS` times, the engines taking turns
  within each (llama.cpp all F32, ds4jax all f32, llama.cpp as converted, ds4jax
  fp4-experts), and each figure reported is its median over the rounds: this VM's speed
  drifts by more than the gaps measured (two single runs minutes apart gave ds4jax's decode
  after 8k 113.5 and 83.3 tok/s), and a drift then weighs on both engines alike. Each
  round's own ratios are kept beside them (`rounds`).
* **Decode in pairs.** A round's two decodes from an empty cache ran a minute or more apart
  and its all-F32 ratio still moved between 0.74× and 1.41× within one run, so after the
  rounds each variant's empty-cache decode runs again in `PAIRS` pairs, llama-bench's `tg32`
  and ds4jax's seconds apart (which goes first alternating), and the report adds the median
  of the pairs' ratios (`decode_pairs`): a figure that a drift over minutes no longer moves.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

LLAMA_VERSION = "0.3.36"
CACHE = Path(os.environ.get("DS4JAX_CACHE", Path.home() / ".cache" / "ds4jax")) / "llama.cpp"
HERE = Path(__file__).resolve().parent / "llamacpp"
PREFILL = (512, 2048, 8192)
DECODE = 32
THREADS = 2
#: rounds of the whole comparison, the engines taking turns within each (`main`)
ROUNDS = 3
#: pairs of empty-cache decodes, the engines seconds apart (`decode_pairs`)
PAIRS = 8
#: which of ds4jax's figures each llama.cpp GGUF is set beside: the same weight bits per token
OURS = {"all_f32": "ds4jax_tok_s", "as_converted": "ds4jax_fp4_experts_tok_s"}


def ours_for(rep: dict[str, Any], variant: str) -> dict[str, float]:
    """ds4jax's tok/s to divide llama.cpp `variant`'s by (f32 in a report older than
    `fp4-experts`)."""
    return rep.get(OURS.get(variant, ""), rep.get("ds4jax_tok_s", {}))


def _run(cmd: list[str], log: Path, **kw: Any) -> None:
    """Run a build step, its output in `log`; raise with the log's tail on failure."""
    with open(log, "a") as f:
        f.write(f"$ {' '.join(map(str, cmd))}\n")
        f.flush()
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, **kw)
    if proc.returncode:
        tail = log.read_text(errors="replace").splitlines()[-15:]
        raise RuntimeError(f"{cmd[0]} failed ({proc.returncode}):\n" + "\n".join(tail))


def source_dir() -> Path:
    return CACHE / f"llama_cpp_python-{LLAMA_VERSION}" / "vendor" / "llama.cpp"


def build() -> dict[str, Path]:
    """llama-bench and the logits dumper, built once into the cache."""
    src = source_dir()
    tools = {"bench": src / "build" / "bin" / "llama-bench",
             "dump": CACHE / f"dump-{LLAMA_VERSION}" / "dump_logits"}  # fmt: skip
    if all(p.is_file() for p in tools.values()):
        return tools
    CACHE.mkdir(parents=True, exist_ok=True)
    log = CACHE / "build.log"
    if not src.is_dir():
        sdist = CACHE / f"llama_cpp_python-{LLAMA_VERSION}.tar.gz"
        if not sdist.is_file():
            print(f"llama.cpp: downloading the llama-cpp-python {LLAMA_VERSION} sdist", flush=True)
            _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                  f"llama-cpp-python=={LLAMA_VERSION}", "-d", str(CACHE)], log)  # fmt: skip
        with tarfile.open(sdist) as tar:
            tar.extractall(CACHE, filter="data")
    if not tools["bench"].is_file():
        print("llama.cpp: building (CMake Release, native, -j 2; minutes, once)", flush=True)
        _run(["cmake", "-S", str(src), "-B", str(src / "build"), "-DCMAKE_BUILD_TYPE=Release",
              "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
              "-DLLAMA_BUILD_SERVER=OFF", "-DBUILD_SHARED_LIBS=OFF"], log)  # fmt: skip
        _run(["cmake", "--build", str(src / "build"), "-j", "2", "--target", "llama-bench"], log)
    # the dumper links the build tree's static libraries (llama-bench built them)
    tools["dump"].parent.mkdir(parents=True, exist_ok=True)
    libs = [
        src / "build" / p
        for p in (
            "src/libllama.a",
            "ggml/src/libggml.a",
            "ggml/src/libggml-cpu.a",
            "ggml/src/libggml-base.a",
        )
    ]
    _run(["g++", "-O2", "-x", "c", str(HERE / "dump_logits.c"), "-x", "none",
          "-I", str(src / "include"), "-I", str(src / "ggml" / "include"), *map(str, libs),
          "-fopenmp", "-lpthread", "-lm", "-o", str(tools["dump"])], log)  # fmt: skip
    return tools


def write_checkpoint(cfg_name: str, seed: int, root: Path) -> Path:
    """The release-layout checkpoint with the V4 tokenizer files the converter reads."""
    from ds4jax.chat.tokenizer import default_tokenizer_json
    from ds4jax.config import load_config
    from ds4jax.model.params import init_params
    from ds4jax.weights.official import write_official_checkpoint

    cfg = load_config(cfg_name)
    # bf16 linears, not FP8: llama.cpp's converter re-quantizes FP8 to Q8_0, which is lossy;
    # bf16 stays exact, so both engines hold the very same weights
    release = write_official_checkpoint(init_params(cfg, seed), cfg, root / "release",
                                        fp8_linears=False)  # fmt: skip
    files = default_tokenizer_json().parent
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (release / name).write_bytes((files / name).read_bytes())
    return release


def all_f32(src: Path, dst: Path) -> Path:
    """A copy of a GGUF with every float tensor in F32: the routed experts (which the
    converter always packs as MXFP4, exactly dequantized), the FP8 linears (which it stores
    as Q8_0 even with `--outtype f32`) and the BF16 ones. llama.cpp then reads as many weight
    bytes per token as ds4jax, which keeps everything in f32. Uses the vendored gguf-py."""
    sys.path.insert(0, str(source_dir() / "gguf-py"))
    try:
        import gguf
        from gguf.quants import dequantize
    finally:
        sys.path.pop(0)
    reader = gguf.GGUFReader(src)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(dst, arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        value = field.contents()
        if field.name == gguf.Keys.General.FILE_TYPE:
            value = int(gguf.LlamaFileType.ALL_F32)
        writer.add_key_value(field.name, value, kind, sub_type=sub)
    tensors = []
    for t in reader.tensors:
        if t.tensor_type not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.I32):
            data = dequantize(t.data, t.tensor_type).astype(np.float32)
            tensors.append((t.name, data, gguf.GGMLQuantizationType.F32))
        else:
            tensors.append((t.name, t.data, t.tensor_type))
    for name, data, kind in tensors:
        writer.add_tensor_info(name, data.shape, data.dtype, data.nbytes, kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, data, _ in tensors:
        writer.write_tensor_data(data, tensor_endianess=reader.endianess)
    writer.close()
    return dst


def convert(checkpoint: Path, out: Path, log: Path) -> Path:
    src = source_dir()
    env = dict(os.environ, PYTHONPATH=str(src / "gguf-py"), NO_LOCAL_GGUF="")
    _run([sys.executable, str(src / "convert_hf_to_gguf.py"), str(checkpoint), "--outfile",
          str(out), "--outtype", "f32"], log, env=env, cwd=src)  # fmt: skip
    return out


def parse_llama_bench(text: str) -> dict[str, float]:
    """`llama-bench -o json` → {"pp512": tok/s, …, "tg32": tok/s} (mean over repetitions);
    a test run after `n_depth` tokens already in the cache is keyed "tg32@d8192"."""
    out: dict[str, float] = {}
    for row in json.loads(text):
        at = f"@d{row['n_depth']}" if row.get("n_depth") else ""
        if row.get("n_prompt") and not row.get("n_gen"):
            out[f"pp{row['n_prompt']}{at}"] = float(row["avg_ts"])
        elif row.get("n_gen") and not row.get("n_prompt"):
            out[f"tg{row['n_gen']}{at}"] = float(row["avg_ts"])
    return out


def llama_bench(tool: Path, gguf: Path, sizes: tuple[int, ...], depth: int = 0
                ) -> dict[str, float]:  # fmt: skip
    """Prefill of each of `sizes` and `DECODE` generated tokens from an empty cache; with
    `depth`, only the decode, after `depth` tokens (llama-bench's `-d`)."""
    prompts = ["-p", ",".join(map(str, sizes))] if sizes else ["-p", "0"]
    cmd = [str(tool), "-m", str(gguf), "-t", str(THREADS), *prompts, "-n", str(DECODE),
           *(["-d", str(depth)] if depth else []), "-r", "2", "-o", "json"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, errors="replace", check=False)
    if proc.returncode:
        raise RuntimeError(f"llama-bench failed: {proc.stderr[-2000:]}")
    return parse_llama_bench(proc.stdout)


def llama_logits(tool: Path, gguf: Path, tokens: list[int], vocab: int) -> np.ndarray:
    with tempfile.TemporaryDirectory() as d:
        ids, out = Path(d) / "tokens.txt", Path(d) / "logits.f32"
        ids.write_text(" ".join(map(str, tokens)))
        cmd = [str(tool), str(gguf), str(ids), str(out), str(THREADS)]
        proc = subprocess.run(cmd, capture_output=True, text=True, errors="replace", check=False)
        if proc.returncode:
            raise RuntimeError(f"dump_logits failed: {proc.stderr[-2000:]}")
        return np.fromfile(out, np.float32).reshape(len(tokens), vocab)


def min_cosine(a: np.ndarray, b: np.ndarray) -> float:
    num = (a * b).sum(-1)
    den = np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1)
    return float((num / den).min())


def medians(runs: list[dict[str, float]]) -> dict[str, float]:
    """Each figure's median over the rounds that measured it."""
    keys = dict.fromkeys(k for run in runs for k in run)
    return {k: float(np.median([run[k] for run in runs if k in run])) for k in keys}


def ratios(ours: dict[str, dict[str, float]], theirs: dict[str, dict[str, float]]
           ) -> dict[str, dict[str, float]]:  # fmt: skip
    """ds4jax / llama.cpp for each figure both measured, per llama.cpp variant."""
    return {name: {k: round(ours[name][k] / v, 3) for k, v in figures.items()
                   if k in ours[name] and v and not math.isnan(v)}
            for name, figures in theirs.items()}  # fmt: skip


def _engine(cfg: Any, params: Any) -> Any:
    """`bench.model`'s ds4jax on these params, without loading a model of its own."""
    from bench.model import Ds4jax

    engine = Ds4jax.__new__(Ds4jax)
    engine.cfg, engine.params = cfg, params
    return engine


def decode_timer(engine: Any, state: Any) -> Any:
    """A timer of greedy decode from `state` (left untouched): tok/s, the better of two runs
    of `DECODE` tokens; the step compiled first."""
    engine.decode(state, 2)
    return lambda: DECODE / min(engine.decode(state, DECODE) for _ in range(2))


def ds4jax_decode(cfg: Any, params: Any) -> Any:
    """`decode_timer` from an empty cache (after one token, beside llama-bench's `tg32`)."""
    engine = _engine(cfg, params)
    tokens = np.random.default_rng(0).integers(2, cfg.vocab_size, 1)
    _, state = engine.prefill(engine.state(1 + DECODE + 8), tokens)
    return decode_timer(engine, state)


def ds4jax_speed(cfg: Any, params: Any, sizes: tuple[int, ...]) -> dict[str, float]:
    """Prefill tok/s at each size (best of two after a compile run) and greedy decode
    tok/s over `DECODE` steps, as `bench.model` measures them: after one token (beside
    llama-bench's `tg32`, which starts from an empty cache) and after the largest prefill
    (beside its `tg32` at that depth, `-d`)."""
    engine = _engine(cfg, params)
    rng = np.random.default_rng(0)
    out: dict[str, float] = {}
    state = None
    for n in sizes:
        toks = rng.integers(2, cfg.vocab_size, n)
        times = []
        for _ in range(3):  # the first run compiles what this length needs
            dt, state = engine.prefill(engine.state(n + DECODE + 8), toks)
            times.append(dt)
        out[f"pp{n}"] = n / min(times[1:])
    deep = decode_timer(engine, state)()
    out[f"tg{DECODE}"] = ds4jax_decode(cfg, params)()
    out[f"tg{DECODE}@d{sizes[-1]}"] = deep
    return out


def decode_pairs(ours: Any, theirs: Any, pairs: int) -> dict[str, Any]:
    """`pairs` pairs of (ours(), theirs()) tok/s, taken seconds apart, theirs first in the
    even pairs and ours in the odd; with the median of the pairs' ratios."""
    got = []
    for i in range(pairs):
        if i % 2:
            a = ours()
            b = theirs()
        else:
            b = theirs()
            a = ours()
        got.append((round(a, 2), round(b, 2)))
    return {"pairs": got, "ratio": round(float(np.median([a / b for a, b in got])), 3)}


def main(quick: bool = False, cfg_name: str = "bench-192m", seed: int = 0) -> dict:
    from bench.disk import use_compile_cache
    from bench.report import write_json
    from ds4jax.chat.tokenizer import load_tokenizer
    from ds4jax.model.forward import prefill
    from ds4jax.model.state import init_state
    from ds4jax.weights.checkpoint import load_model

    use_compile_cache()
    sizes = PREFILL[:1] if quick else PREFILL
    out: dict[str, Any] = {"date": datetime.now().isoformat(timespec="seconds"), "quick": quick,
                           "config": cfg_name, "llama_cpp": f"llama-cpp-python {LLAMA_VERSION} "
                           "vendored llama.cpp", "threads": THREADS}  # fmt: skip
    try:
        t0 = time.perf_counter()
        tools = build()
        out["build_s"] = round(time.perf_counter() - t0, 1)
    except Exception as err:  # no network, no compiler: say so, the bench goes on
        out["skipped"] = f"llama.cpp could not be built here: {err}"
        print(out["skipped"], flush=True)
        write_json("llamacpp", out, quick)
        return out
    root = Path(tempfile.mkdtemp(prefix="ds4jax-bench-llamacpp-"))
    try:
        log = root / "convert.log"
        release = write_checkpoint(cfg_name, seed, root)
        mxfp4 = convert(release, root / "mxfp4.gguf", log)
        ggufs = {"as_converted": mxfp4, "all_f32": all_f32(mxfp4, root / "f32.gguf")}
        cfg, params, tok, _ = load_model(str(release), load_tokenizer=load_tokenizer)
        text = "The engine keeps the sampled state as the truth and appends only the suffix. "
        tokens = [tok.bos_id, *tok.encode_text(text * 6)][:64]
        ours = {}
        for quant_sim in (True, False):
            c = cfg.replace(quant_sim=quant_sim)
            _, lg = prefill(params, init_state(c, 80), tokens, c, all_logits=True)
            ours[quant_sim] = np.asarray(lg, np.float32)
        out["logits"] = {}
        for name, gguf in ggufs.items():
            theirs = llama_logits(tools["dump"], gguf, tokens, cfg.vocab_size)
            out["logits"][name] = {
                "tokens": len(tokens),
                "min_cosine_quant_sim_on": round(min_cosine(ours[True], theirs), 6),
                "min_cosine_quant_sim_off": round(min_cosine(ours[False], theirs), 6),
            }
            print(f"logits vs llama.cpp ({name}): {out['logits'][name]}", flush=True)
        _, fp4, _, _ = load_model(
            str(release), weights="fp4-experts", load_tokenizer=load_tokenizer
        )
        ours_params = {"all_f32": params, "as_converted": fp4}
        same_math = cfg.replace(quant_sim=False)  # as llama.cpp: no FP8 KV / FP4 indexer
        rounds = []
        for r in range(1 if quick else ROUNDS):
            one: dict[str, Any] = {"llama_cpp": {}, "ds4jax": {}}
            for name, gguf in ggufs.items():  # the engines take turns, variant by variant
                one["llama_cpp"][name] = {
                    **llama_bench(tools["bench"], gguf, sizes),
                    **llama_bench(tools["bench"], gguf, (), depth=sizes[-1]),
                }
                one["ds4jax"][name] = ds4jax_speed(same_math, ours_params[name], sizes)
                print(f"round {r + 1} {name}: llama.cpp {one['llama_cpp'][name]}, "
                      f"ds4jax {one['ds4jax'][name]}", flush=True)  # fmt: skip
            one["ratios"] = ratios(one["ds4jax"], one["llama_cpp"])
            rounds.append(one)
        out["decode_pairs"] = {}
        for name, gguf in ggufs.items():
            pairs = decode_pairs(ds4jax_decode(same_math, ours_params[name]),
                                 lambda gguf=gguf: llama_bench(tools["bench"], gguf, ())[
                                     f"tg{DECODE}"],
                                 2 if quick else PAIRS)  # fmt: skip
            out["decode_pairs"][name] = pairs
            print(f"decode in pairs {name} (ds4jax, llama.cpp tok/s): {pairs}", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    out["rounds"] = rounds
    out["llama_cpp_tok_s"] = {name: medians([r["llama_cpp"][name] for r in rounds])
                              for name in ggufs}  # fmt: skip
    for name, key in OURS.items():
        out[key] = medians([r["ds4jax"][name] for r in rounds])
    out["ratios"] = ratios({name: out[OURS[name]] for name in ggufs}, out["llama_cpp_tok_s"])
    print(f"ds4jax / llama.cpp (medians of {len(rounds)} rounds): {out['ratios']}", flush=True)
    write_json("llamacpp", out, quick)
    return out


if __name__ == "__main__":
    main(quick="--quick" in sys.argv)
