"""Cost of the tinker protobuf codec (gateway/api/tinker_wire) on SDK-sized payloads.

A ``forward_backward`` chunk as the SDK cuts it (``fwdbwd_max_chunk_bytes_count`` = 5 MB estimated):
``--datums`` datums of ``--tokens`` tokens with ``target_tokens`` (int64), ``logprobs`` and ``advantages``
(float32), the RL shape; encoded with the same message layout the SDK writes. Timed: zstd decompression
(``Content-Encoding: zstd``, as with ``proto_compress_fwdbwd``), protobuf parse + conversion + pydantic
validation into ``ForwardBackwardRequestV2``; and the two protobuf results the SDK reads
(``ForwardBackwardOutput`` with per-datum logprobs; a ``SampleResponse`` with ``--samples`` sequences of
``--tokens`` tokens, logprobs and top-``--topk`` logprobs). Median of ``--repeat`` runs; prints figures only.

Usage: ``python bench/tinker_wire.py [--datums 128] [--tokens 1024] [--samples 16] [--topk 5] [--repeat 5]``
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import zstandard

from livelora.clients.types.tinker import ForwardBackwardOutput, TensorData
from livelora.clients.types.tinker_ext import SampledSequenceV2, SampleResponseV2
from livelora.gateway.api import tinker_wire as wire
from livelora.gateway.api.tinker_wire import schema


def request_body(datums: int, tokens: int, rng: np.random.Generator) -> bytes:
    msg = schema.ForwardBackwardRequest(model_id="bench:train:0", seq_id=1, loss_fn="importance_sampling")
    for _ in range(datums):
        d = msg.data.add()
        d.model_input.add().encoded_text.tokens = rng.integers(0, 49152, tokens, dtype="<i4").tobytes()
        for name, dtype, proto_dtype in (("target_tokens", "<i8", 2), ("logprobs", "<f4", 1), ("advantages", "<f4", 1)):
            t = d.loss_fn_inputs[name]
            t.dtype = proto_dtype
            t.shape.append(tokens)
            values = rng.integers(0, 49152, tokens) if dtype == "<i8" else -rng.random(tokens)
            t.dense = values.astype(dtype).tobytes()
    return msg.SerializeToString()


def timed(fn, repeat: int) -> float:
    runs = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t0)
    return statistics.median(runs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--datums", type=int, default=128)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--topk", type=int, default=5)
    p.add_argument("--repeat", type=int, default=5)
    a = p.parse_args()
    rng = np.random.default_rng(0)
    print(f"load average {os.getloadavg()[0]:.2f}; {a.datums} datums x {a.tokens} tokens")

    raw = request_body(a.datums, a.tokens, rng)
    packed = zstandard.ZstdCompressor().compress(raw)
    positions = a.datums * a.tokens
    s_zstd = timed(lambda: wire.decode_content(packed, "zstd"), a.repeat)
    s_decode = timed(lambda: wire.decode_forward_backward(raw), a.repeat)
    print(
        f"forward_backward request: {len(raw) / 1e6:.2f} MB protobuf, {len(packed) / 1e6:.2f} MB zstd; "
        f"unzstd {s_zstd * 1e3:.1f} ms; decode+validate {s_decode * 1e3:.1f} ms "
        f"({positions / s_decode / 1e6:.2f} M positions/s)"
    )

    out = ForwardBackwardOutput(
        loss_fn_outputs=[
            {
                "logprobs": TensorData(
                    data=(-rng.random(a.tokens)).astype(np.float32).tolist(), dtype="float32", shape=[a.tokens]
                )
            }
            for _ in range(a.datums)
        ],
        metrics={"loss:sum": 1.0},
    )
    s_out = timed(lambda: wire.encode_forward_backward_output(out), a.repeat)
    print(
        f"ForwardBackwardOutput: {len(wire.encode_forward_backward_output(out)) / 1e6:.2f} MB; "
        f"encode {s_out * 1e3:.1f} ms"
    )

    def seq() -> SampledSequenceV2:
        toks = rng.integers(0, 49152, a.tokens).tolist()
        lps = (-rng.random(a.tokens)).astype(np.float32).tolist()
        return SampledSequenceV2(
            stop_reason="length",
            tokens=toks,
            logprobs=lps,
            topk_logprobs=[[(t, lp)] * a.topk for t, lp in zip(toks, lps)],
        )

    resp = SampleResponseV2(sequences=[seq() for _ in range(a.samples)])
    s_sample = timed(lambda: wire.encode_sample_response(resp), a.repeat)
    print(
        f"SampleResponse ({a.samples} x {a.tokens} tokens, top-{a.topk}): "
        f"{len(wire.encode_sample_response(resp)) / 1e6:.2f} MB; encode {s_sample * 1e3:.1f} ms"
    )


if __name__ == "__main__":
    main()
