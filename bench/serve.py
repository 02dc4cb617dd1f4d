"""Serving benchmark: N concurrent streaming clients against the gateway vs sequential ``model.generate``.

Prints requests/s, output tokens/s, time to first token p50/p99 and inter-token latency p50 for the gateway, then
the throughput ratio against plain ``transformers`` ``generate`` on the same prompts (greedy, exactly
``max_tokens`` tokens on both sides). ``--anchors`` compares with an adapter on every request against offline
peft; ``--metering-ab R`` measures metering and ``/metrics`` on vs off in alternating rounds. Method:
``docs/internals/bench.md``.

    python bench/serve.py --spawn                       # start a gateway itself (engine kind: --engine)
    python bench/serve.py --url http://127.0.0.1:8000   # an already running gateway
    python bench/serve.py --metering-ab 3               # metering + /metrics on vs off, two gateways, same run
    python bench/serve.py --anchors                     # with an adapter on every request vs offline peft
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how rain forms.",
    "List some tips for learning a new language.",
    "Describe a busy market in the morning.",
    "What makes a good friend?",
    "Tell me about the history of bicycles.",
    "Give advice to a new gardener.",
    "Describe the ocean to someone who has never seen it.",
]


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) by nearest rank; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


async def one_stream(
    client: httpx.AsyncClient,
    model: str,
    prompt: str,
    max_tokens: int,
    *,
    temperature: float = 0.0,
    seed: int | None = None,
    ignore_eos: bool = True,
    user: str | None = None,
) -> dict:
    """One streamed chat completion (usage included; ``user``: the OpenAI ``user`` field, which picks a segment).
    Returns its ``id``, ``text``, completion ``tokens`` (the server's ``usage``), ``version`` (from
    ``system_fingerprint``), ``end`` and ``first`` (``perf_counter`` seconds of the last chunk and of the first
    content chunk), ``ttft`` (seconds to the first content chunk) and ``itl`` (seconds between content chunks).
    Raises: httpx errors for a non-2xx answer, RuntimeError for an error event."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:
        body["ignore_eos"] = True
    if seed is not None:
        body["seed"] = seed
    if user is not None:
        body["user"] = user
    start = time.perf_counter()
    stamps: list[float] = []
    text, tokens, cid, fingerprint = [], 0, None, None
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            cid = chunk.get("id", cid)
            fingerprint = chunk.get("system_fingerprint") or fingerprint
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                stamps.append(time.perf_counter())
                text.append(chunk["choices"][0]["delta"]["content"])
    return {
        "id": cid,
        "text": "".join(text),
        "tokens": tokens,
        "end": time.perf_counter(),
        "first": stamps[0] if stamps else float("nan"),
        "version": (fingerprint or "").removeprefix("livelora-"),
        "ttft": stamps[0] - start if stamps else float("nan"),
        "itl": [b - a for a, b in itertools.pairwise(stamps)],
    }


async def run_gateway(url: str, model: str, concurrency: int, requests: int, max_tokens: int) -> dict:
    """``requests`` streaming requests, at most ``concurrency`` in flight."""
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        await one_stream(client, model, "Hi", 2)  # warm-up
        queue = list(range(requests))
        results: list[dict] = []

        async def worker() -> None:
            while queue:
                i = queue.pop()
                results.append(await one_stream(client, model, PROMPTS[i % len(PROMPTS)], max_tokens))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    tokens = sum(r["tokens"] for r in results)
    return {
        "elapsed_s": elapsed,
        "requests_per_s": requests / elapsed,
        "tokens_per_s": tokens / elapsed,
        "tokens": tokens,
        "ttft_p50_s": percentile([r["ttft"] for r in results], 0.5),
        "ttft_p99_s": percentile([r["ttft"] for r in results], 0.99),
        "itl_p50_s": percentile([x for r in results for x in r["itl"]], 0.5),
    }


def run_baseline(model_name: str, requests: int, max_tokens: int, device: str) -> dict:
    """The same prompts as sequential ``model.generate`` calls (greedy, exactly ``max_tokens`` new tokens)."""
    import torch

    from livelora.core.base_models import load_model, load_tokenizer, resolve_base_model
    from livelora.core.settings import CommonSettings

    ref = resolve_base_model(model_name, CommonSettings().home)
    tokenizer = load_tokenizer(ref)
    model = load_model(ref, device=device)

    def generate(prompt: str, n: int) -> int:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
        ids = torch.tensor([tokenizer.encode(text, add_special_tokens=False)], device=device)
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=tokenizer.eos_token_id,
            )
        return out.shape[1] - ids.shape[1]

    generate("Hi", 2)  # warm-up
    start = time.perf_counter()
    tokens = sum(generate(PROMPTS[i % len(PROMPTS)], max_tokens) for i in reversed(range(requests)))
    elapsed = time.perf_counter() - start
    return {
        "elapsed_s": elapsed,
        "requests_per_s": requests / elapsed,
        "tokens_per_s": tokens / elapsed,
        "tokens": tokens,
    }


def spawn(
    engine: str,
    model: str,
    max_batch_size: int,
    device: str | None,
    env: dict[str, str] | None = None,
    extra: list[str] | None = None,
) -> tuple[subprocess.Popen, str]:
    """Start ``livelora serve`` on a free port (``env`` added to the environment, ``extra`` to its flags) and wait
    for ``/health``."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "livelora.cli.main",
        "serve",
        "--port",
        str(port),
        "--engine",
        engine,
        "--model",
        model,
        "--max-batch-size",
        str(max_batch_size),
        "--log-level",
        "warning",
    ]
    if device:
        cmd += ["--device", device]
    cmd += extra or []
    proc = subprocess.Popen(cmd, env={**os.environ, **(env or {})})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise SystemExit("the server did not become ready")


def wait_idle(procs: list[subprocess.Popen], below: float = 0.05, window_s: float = 2.0, limit_s: float = 600) -> None:
    """Block until the spawned gateways and their children (the trainer, the Redis a gateway started) use less than
    ``below`` of one core, summed, over two windows of ``window_s`` in a row: the start-up work (the evaluation
    gate's base measurement, loading a published version) is then done and no longer shares the cores with the
    timed rounds. Prints how long it waited. Raises: SystemExit after ``limit_s``."""
    import psutil

    def cpu_seconds() -> float:
        total = 0.0
        for proc in procs:
            try:
                parent = psutil.Process(proc.pid)
                for p in [parent, *parent.children(recursive=True)]:
                    t = p.cpu_times()
                    total += t.user + t.system
            except psutil.Error:  # a child that exited between listing and reading
                continue
        return total

    start, quiet = time.monotonic(), 0
    used = cpu_seconds()
    while quiet < 2:
        if time.monotonic() - start > limit_s:
            raise SystemExit(f"the gateways stayed busy for {limit_s:.0f} s after start-up")
        time.sleep(window_s)
        now = cpu_seconds()
        quiet = quiet + 1 if (now - used) / window_s < below else 0
        used = now
    print(
        f"gateways idle after {time.monotonic() - start:.0f} s (their processes under {below:.0%} of a core "
        f"for {2 * window_s:.0f} s; load avg 1 min {os.getloadavg()[0]:.2f})",
        flush=True,
    )


def odd_rounds(value: str) -> int:
    """argparse type: a positive odd number of rounds (the median is then one round's figure)."""
    n = int(value)
    if n < 1 or n % 2 == 0:
        raise argparse.ArgumentTypeError(f"{n}: give an odd number of rounds (the median of an even count is no round)")
    return n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--url", help="base URL of a running gateway (without /v1)")
    where.add_argument("--spawn", action="store_true", help="start a gateway on a free port")
    parser.add_argument("--engine", default="transformers", help="engine kind when spawning")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--device", default=None, help="torch device for the spawned server and the baseline")
    parser.add_argument("--concurrency", type=int, default=8, help="concurrent streaming clients (N)")
    parser.add_argument("--requests", type=int, default=16, help="total requests (M)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-batch-size", type=int, default=8, help="engine batch when spawning")
    parser.add_argument("--no-baseline", action="store_true")
    parser.add_argument(
        "--metering-ab",
        type=odd_rounds,
        default=0,
        metavar="ROUNDS",
        help="compare metering+metrics off vs on (two spawned gateways, alternating rounds; an odd number)",
    )
    parser.add_argument("--anchors", action="store_true", help="adapter on every request vs offline peft anchors")
    parser.add_argument(
        "--rounds",
        type=odd_rounds,
        default=3,
        help="--anchors: alternating rounds (odd; each printed, then the median)",
    )
    parser.add_argument("--rank", type=int, default=16, help="--anchors: LoRA rank of the adapter")
    parser.add_argument(
        "--weights",
        default="fp32",
        help="--anchors: comma-separated LIVELORA_ENGINE_WEIGHTS values, one gateway each, measured in the same "
        "run; 'llama_cpp' is a gateway with --engine llama_cpp (its default weights, f16), 'llama_cpp:gguf' one "
        "serving the GGUF file's own types",
    )
    parser.add_argument("--ab-on-first", action="store_true", help="with --metering-ab: start and run 'on' first")
    args = parser.parse_args()
    if args.metering_ab:
        return metering_ab(args)
    if args.anchors:
        return anchors(args)
    if not (args.url or args.spawn):
        parser.error("one of the arguments --url --spawn --metering-ab is required")

    proc = None
    url = args.url
    if args.spawn:
        proc, url = spawn(args.engine, args.model, args.max_batch_size, args.device)
        wait_idle([proc])
    try:
        gw = asyncio.run(run_gateway(url, args.model, args.concurrency, args.requests, args.max_tokens))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=60)
    print(
        f"gateway ({args.engine if args.spawn else url}): {args.concurrency} concurrent streams, "
        f"{args.requests} requests x {args.max_tokens} tokens"
    )
    print(f"  requests/s        {gw['requests_per_s']:.2f}")
    print(f"  output tokens/s   {gw['tokens_per_s']:.1f}  ({gw['tokens']} tokens in {gw['elapsed_s']:.1f} s)")
    print(f"  TTFT p50 / p99    {gw['ttft_p50_s'] * 1000:.0f} ms / {gw['ttft_p99_s'] * 1000:.0f} ms")
    print(f"  ITL p50           {gw['itl_p50_s'] * 1000:.1f} ms")
    if args.no_baseline:
        return
    device = args.device or ("cuda" if _cuda() else "cpu")
    base = run_baseline(args.model, args.requests, args.max_tokens, device)
    print(f"sequential model.generate ({device}): {args.requests} requests x {args.max_tokens} tokens")
    print(f"  requests/s        {base['requests_per_s']:.2f}")
    print(f"  output tokens/s   {base['tokens_per_s']:.1f}  ({base['tokens']} tokens in {base['elapsed_s']:.1f} s)")
    print(f"ratio gateway / sequential (output tokens/s): {gw['tokens_per_s'] / base['tokens_per_s']:.2f}x")


def offline_generate(model, tokenizer, prompts: list[str], max_tokens: int, batch: int) -> dict:
    """``prompts`` through ``model.generate`` in static batches of ``batch`` (left-padded, greedy, exactly
    ``max_tokens`` new tokens each); returns elapsed seconds, output tokens and tokens/s."""
    import torch

    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    texts = [
        tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
        for p in prompts
    ]
    tokens, start = 0, time.perf_counter()
    for i in range(0, len(texts), batch):
        enc = tokenizer(texts[i : i + batch], return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.inference_mode():
            out = model.generate(
                **enc,
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
            )
        tokens += (out.shape[1] - enc["input_ids"].shape[1]) * out.shape[0]
    elapsed = time.perf_counter() - start
    return {"elapsed_s": elapsed, "tokens": tokens, "tokens_per_s": tokens / elapsed}


def llama_cpp_generate(llm, tokenizer, prompts: list[str], max_tokens: int) -> dict:
    """``prompts`` one at a time through llama.cpp (``llama_cpp.Llama``: the built-in GGUF with the version's
    ``--format gguf`` export as its LoRA), greedy, exactly ``max_tokens`` new tokens each (end-of-sequence
    suppressed, as ``min_new_tokens`` does offline); returns elapsed seconds, output tokens and tokens/s."""
    tokens, start = 0, time.perf_counter()
    for p in prompts:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
        )
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        out = llm.create_completion(
            ids, max_tokens=max_tokens, temperature=0.0, logit_bias={tokenizer.eos_token_id: -1e9}
        )
        tokens += out["usage"]["completion_tokens"]
    elapsed = time.perf_counter() - start
    return {"elapsed_s": elapsed, "tokens": tokens, "tokens_per_s": tokens / elapsed}


_ANCHOR: list = []  # in an anchor's child process: (llama_cpp.Llama, tokenizer)


def _anchor_init(model: str, home: str, fmt: str, lora: str) -> None:
    from llama_cpp import Llama

    from livelora.core.base_models import gguf_location, load_tokenizer, resolve_base_model
    from livelora.gateway.engines.llama_cpp.model import served_gguf

    gguf = served_gguf(gguf_location(model), fmt, Path(home) / "models" / "gguf")
    llm = Llama(str(gguf), lora_path=lora, n_ctx=1024, n_threads=os.cpu_count(), verbose=False)
    _ANCHOR[:] = [llm, load_tokenizer(resolve_base_model(model, Path(home)))]


def _anchor_generate(prompts: list[str], max_tokens: int) -> dict:
    return llama_cpp_generate(_ANCHOR[0], _ANCHOR[1], prompts, max_tokens)


def llama_cpp_anchor(pools: dict, fmt: str, prompts: list[str], max_tokens: int, model: str, home) -> dict:
    """:func:`llama_cpp_generate` in the anchor's child process for ``fmt`` (timed there); a native crash is a
    SystemExit naming the canary's finding (``bench/hotswap.py``'s :func:`native_result`)."""
    import hotswap

    future = pools[fmt].submit(_anchor_generate, prompts, max_tokens)
    return hotswap.native_result(future, f"llama.cpp anchor [{fmt}]", model, Path(home), fmt)


def anchors(args) -> None:
    """The gateway with an adapter on every request against offline ``generate`` with the same adapter (see the
    module docstring): ``--rounds`` alternating rounds of gateway N streams, static batch N, gateway 1 stream,
    batch 1 (and llama.cpp at one stream on the built-in GGUF with the same version, where llama-cpp-python is
    installed); prints each and the medians."""
    import importlib.util
    import tempfile
    import uuid

    import redis
    from peft import PeftModel

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import hotswap  # the trainer-side publisher of bench/hotswap.py

    from livelora.adapters.store import AdapterStore
    from livelora.core.base_models import BUILTIN_GGUF, load_model, load_tokenizer, resolve_base_model
    from livelora.core.redis_keys import KeyLayout
    from livelora.core.settings import CommonSettings

    settings = CommonSettings()
    ref = resolve_base_model(args.model, settings.home)
    weights = [w.strip() for w in args.weights.split(",") if w.strip()]
    gateways: dict[str, tuple[subprocess.Popen, str, Path]] = {}  # weights → (process, url, home)
    rows: dict[str, list[dict]] = {}
    for w in weights:
        rows[f"gateway_n[{w}]"] = []
        if w == weights[0]:
            rows["static_n"] = []
    for w in weights:
        rows[f"gateway_1[{w}]"] = []
        if w == weights[0]:
            rows["generate_1"] = []
    llms = {}  # llama.cpp anchor format -> its child process (a one-process pool holding llama_cpp.Llama)
    if importlib.util.find_spec("llama_cpp") is not None and args.model in BUILTIN_GGUF:
        # llama.cpp on the built-in GGUF as shipped, and on each other format a llama_cpp gateway serves
        for fmt in dict.fromkeys(["gguf"] + [hotswap.LLAMA_CPP[w] for w in weights if w in hotswap.LLAMA_CPP]):
            rows[f"llama_cpp_1[{fmt}]"] = []
    else:
        print("llama.cpp anchor left out: llama-cpp-python is not installed, or --model is not the built-in GGUF")
    try:
        for w in weights:  # one store and prefix per gateway; the same seeded version published to each
            home = Path(tempfile.mkdtemp(prefix="livelora-anchors-"))
            (home / "models").symlink_to(Path(settings.home) / "models", target_is_directory=True)
            keys = KeyLayout(f"livelora-bench-anchors-{uuid.uuid4().hex[:8]}:")
            env = {
                "LIVELORA_HOME": str(home),
                "LIVELORA_REDIS_PREFIX": keys.prefix,
                "LIVELORA_METERING": "false",
            }
            env["LIVELORA_ENGINE_WEIGHTS"] = hotswap.LLAMA_CPP.get(w, w)
            proc, url = spawn(
                "llama_cpp" if w in hotswap.LLAMA_CPP else args.engine,
                args.model,
                args.max_batch_size,
                args.device,
                env,
                ["--served-model-name", hotswap.EP],
            )
            gateways[w] = (proc, url, home)
            publisher = hotswap.Publisher(ref, home, keys, redis.Redis.from_url(settings.redis_url), args.rank)
            name, _, _ = publisher.publish()
            del publisher

            async def served(url=url, name=name) -> str | None:
                async with httpx.AsyncClient(base_url=url, timeout=120) as client:
                    for _ in range(600):
                        r = await hotswap.stream_chat(client, "probe", "Hello", 1)
                        if r.version == name:
                            return r.version
                        await asyncio.sleep(0.1)
                return None

            if asyncio.run(served()) != name:
                raise SystemExit(f"the {w} gateway did not serve {name} within a minute")
        home = gateways[weights[0]][2]
        tokenizer = load_tokenizer(ref)
        model = PeftModel.from_pretrained(
            load_model(ref, device=args.device or "cpu"), str(AdapterStore(home).version_dir(hotswap.EP, 1))
        )
        model.eval()
        offline_generate(model, tokenizer, PROMPTS[:2], 2, 2)  # warm-up
        if any(k.startswith("llama_cpp_1") for k in rows):
            from livelora.adapters.gguf_export import GGUF_FILE, export_gguf

            lora = export_gguf(AdapterStore(home), hotswap.EP, 1, ref, Path(tempfile.mkdtemp()) / "gguf") / GGUF_FILE
            for kind in [k for k in rows if k.startswith("llama_cpp_1")]:  # each in a child process of its own
                fmt = kind[12:-1]
                llms[fmt] = hotswap.native_pool(_anchor_init, (args.model, str(settings.home), fmt, str(lora)))
                try:  # warm-up; a native crash leaves this anchor out, with the canary's reason
                    llama_cpp_anchor(llms, fmt, PROMPTS[:1], 2, args.model, settings.home)
                except SystemExit as exc:
                    print(f"llama.cpp anchor [{fmt}] left out: {exc}")
                    del rows[kind], llms[fmt]
        n = args.concurrency
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.requests)]
        ones = max(2, args.requests // n)
        wait_idle([proc for proc, _, _ in gateways.values()])
        for r in range(args.rounds):
            for kind in rows:
                load = os.getloadavg()[0]
                url = gateways[kind[10:-1]][1] if kind.startswith("gateway") else ""
                if kind.startswith("gateway_n"):
                    res = asyncio.run(run_gateway(url, hotswap.EP, n, args.requests, args.max_tokens))
                elif kind.startswith("gateway_1"):
                    res = asyncio.run(run_gateway(url, hotswap.EP, 1, ones, args.max_tokens))
                elif kind == "static_n":
                    res = offline_generate(model, tokenizer, prompts, args.max_tokens, n)
                elif kind.startswith("llama_cpp_1"):
                    res = llama_cpp_anchor(
                        llms, kind[12:-1], prompts[:ones], args.max_tokens, args.model, settings.home
                    )
                else:
                    res = offline_generate(model, tokenizer, prompts[:ones], args.max_tokens, 1)
                res["load"] = load
                rows[kind].append(res)
                print(
                    f"round {r + 1} {kind:16}: {res['tokens_per_s']:.1f} tokens/s ({res['tokens']} tokens in "
                    f"{res['elapsed_s']:.1f} s; load avg 1 min {load:.2f})",
                    flush=True,
                )
    finally:
        for proc, _, _ in gateways.values():
            proc.terminate()
            proc.wait(timeout=60)
        for pool in llms.values():
            pool.shutdown(cancel_futures=True)
    med = {k: percentile([x["tokens_per_s"] for x in v], 0.5) for k, v in rows.items()}
    print(
        f"median of {args.rounds} rounds, adapter {name} (rank {args.rank}) on every request, "
        f"{args.max_tokens} tokens per request (load avg 1/5/15 min now "
        f"{' / '.join(f'{x:.2f}' for x in os.getloadavg())}):"
    )
    for w in weights:
        gn, g1 = med[f"gateway_n[{w}]"], med[f"gateway_1[{w}]"]
        print(
            f"  [{w}] gateway {n} streams {gn:.1f} tok/s vs static batch {n} (fp32) {med['static_n']:.1f} tok/s: "
            f"{gn / med['static_n']:.2f}x; vs [{weights[0]}] {gn / med[f'gateway_n[{weights[0]}]']:.2f}x"
        )
        print(
            f"  [{w}] gateway 1 stream  {g1:.1f} tok/s vs generate batch 1 (fp32) {med['generate_1']:.1f} tok/s: "
            f"{g1 / med['generate_1']:.2f}x; vs [{weights[0]}] {g1 / med[f'gateway_1[{weights[0]}]']:.2f}x"
        )
        for fmt in [k[12:-1] for k in med if k.startswith("llama_cpp_1")]:
            a = med[f"llama_cpp_1[{fmt}]"]
            print(
                f"  [{w}] gateway 1 stream  {g1:.1f} tok/s vs llama.cpp 1 stream (the GGUF in format {fmt} + the "
                f"version as a GGUF LoRA) {a:.1f} tok/s: {g1 / a:.2f}x"
            )


def metering_ab(args) -> None:
    """Two gateways (metering and /metrics off, on), ``args.metering_ab`` alternating rounds; prints each round
    with the load average and the medians of output tokens/s and TTFT p50."""
    off_env = {"LIVELORA_METERING": "false", "LIVELORA_METRICS": "false"}
    servers = {}
    try:
        order = ("on", "off") if args.ab_on_first else ("off", "on")
        for side in order:  # --ab-on-first swaps which gateway starts (and runs) first: a position bias shows
            servers[side] = spawn(
                args.engine, args.model, args.max_batch_size, args.device, off_env if side == "off" else {}
            )
        runs: dict[str, list[dict]] = {"off": [], "on": []}
        wait_idle([proc for proc, _ in servers.values()])
        for r in range(args.metering_ab):
            for side in order:
                load = os.getloadavg()[0]
                gw = asyncio.run(
                    run_gateway(servers[side][1], args.model, args.concurrency, args.requests, args.max_tokens)
                )
                if side == "on":  # a scrape per round, as Prometheus would
                    httpx.get(servers[side][1] + "/metrics", timeout=30).raise_for_status()
                gw["load"] = load
                runs[side].append(gw)
                print(
                    f"round {r + 1} metering {side:3}: {gw['tokens_per_s']:.1f} tokens/s, TTFT p50 "
                    f"{gw['ttft_p50_s'] * 1000:.0f} ms, ITL p50 {gw['itl_p50_s'] * 1000:.1f} ms "
                    f"(load avg 1 min {load:.2f})",
                    flush=True,
                )
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(timeout=60)
    med = {
        side: {k: percentile([g[k] for g in rs], 0.5) for k in ("tokens_per_s", "ttft_p50_s", "itl_p50_s")}
        for side, rs in runs.items()
    }
    print(
        f"median of {args.metering_ab} rounds, {args.concurrency} streams x {args.requests} requests x "
        f"{args.max_tokens} tokens (load avg 1/5/15 min now {' / '.join(f'{x:.2f}' for x in os.getloadavg())}):"
    )
    for side in ("off", "on"):
        m = med[side]
        print(
            f"  metering {side:3}: {m['tokens_per_s']:.1f} tokens/s, TTFT p50 {m['ttft_p50_s'] * 1000:.0f} ms, "
            f"ITL p50 {m['itl_p50_s'] * 1000:.1f} ms"
        )
    change = med["on"]["tokens_per_s"] / med["off"]["tokens_per_s"] - 1
    print(f"  tokens/s on vs off: {change * 100:+.1f} %")
    print(
        f"one metering write (MULTI of HINCRBYs on Redis), median of 500: {metering_write_ms():.3f} ms "
        f"(load avg 1 min {os.getloadavg()[0]:.2f})"
    )


def metering_write_ms(n: int = 500) -> float:
    """Median wall time (ms) of the write a served request adds: one ``Meter.record_sync`` of two kinds."""
    import uuid

    from livelora.core.bus import connect_sync
    from livelora.core.metering import Meter, Usage
    from livelora.core.redis_keys import KeyLayout
    from livelora.core.settings import CommonSettings

    keys = KeyLayout(f"livelora-bench-{uuid.uuid4().hex[:8]}:")
    client = connect_sync(CommonSettings().redis_url)
    meter, times = Meter(keys), []
    try:
        for _ in range(n):
            start = time.perf_counter()
            meter.record_sync(client, Usage("bench", "k", "ep", {"prompt": 20, "completion": 32}))
            times.append((time.perf_counter() - start) * 1000)
    finally:
        for key in client.scan_iter(f"{keys.prefix}*"):
            client.delete(key)
        client.close()
    return percentile(times, 0.5)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    main()
