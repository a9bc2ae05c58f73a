"""A real vLLM engine (CPU build, SmolLM2, ATTN_OTEL=1) in a process of its own, driven by JSON lines.

``python driver.py MODEL CONFIG_JSON REPLY_FD``: the environment (``ATTN_OTEL_*``, ``AWS_*``, ``OTEL_*``)
comes from the parent.  Commands arrive on stdin, one JSON object a line; each answer is one JSON line on
the pipe ``REPLY_FD`` (stdout and stderr stay free for vLLM's and the writers' logs, which the tests read).
A process of its own, so that a test can measure its memory (and its writer processes'), time its exit,
and be sure a hang in it never hangs pytest.

Every record of the ``attn_otel`` loggers (DEBUG and up, with tracebacks) also goes to ``CONFIG["attn_log"]``.
"""

import json
import logging
import os
import sys
import time


def _kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    return 0


def main() -> None:
    model, config, reply_fd = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    reply = os.fdopen(reply_fd, "w", buffering=1)
    handler = logging.FileHandler(config["attn_log"])
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s %(message)s"))
    attn_logger = logging.getLogger("attn_otel")
    attn_logger.addHandler(handler)
    attn_logger.setLevel(logging.DEBUG)


    from vllm import LLM, SamplingParams

    from attn_otel import vllm_adapter

    t0 = time.monotonic()
    llm = LLM(model=model, max_model_len=config.get("max_model_len", 1024),
              max_num_batched_tokens=config.get("max_num_batched_tokens", 1024),
              max_num_seqs=config.get("max_num_seqs", 256), enable_prefix_caching=False, seed=0,
              # no dynamo trace (~10 s of the first request): these tests are about the store and the hand-off,
              # whatever runs the model's other layers
              enforce_eager=config.get("enforce_eager", True),
              # float32, not the checkpoint's bf16: this CPU build's bf16 GEMMs run about 10x slower than its
              # float32 ones on CPUs without AVX-512 BF16 (the CI machine's), and what these tests check (the
              # store, the hand-offs, their byte bounds, the counters) does not depend on the model's dtype
              dtype=config.get("dtype", "float32"))
    (cap,) = vllm_adapter.engines()

    def writer_pids() -> list[int]:
        return [p.pid for p in cap.writers.procs if p.poll() is None]

    def stats() -> dict:
        snap = cap.stats.snapshot()
        snap.update(pending_bytes=cap.handoff.pending_bytes, device_bytes=cap.device_budget.pending_bytes,
                    writer_pids=writer_pids(), pid=os.getpid(), layers=list(cap.layer_ids))
        return snap

    reply.write(json.dumps({"ready": True, "start_s": time.monotonic() - t0, "stats": stats()}) + "\n")
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        out: dict = {}
        if op == "generate":
            prompts = cmd["prompts"]
            extra = cmd.get("extra_args")
            if not isinstance(extra, list):
                extra = [extra] * len(prompts)
            big = cmd.get("huge")  # hostile values too large for a command line: built here
            if big == "layers_1e6":
                extra = [{**(e or {}), "attn_otel_layers": list(range(10**6))} for e in extra]
            elif big == "string_10mb":
                extra = [{**(e or {}), "attn_otel_layers": "0," * (5 << 20), "attn_otel": "x" * (10 << 20)}
                         for e in extra]
            params, kept, rejected = [], [], []
            for p, e in zip(prompts, extra):
                try:
                    params.append(SamplingParams(max_tokens=cmd.get("max_tokens", 8), temperature=0.0,
                                                 ignore_eos=cmd.get("ignore_eos", True), extra_args=e))
                    kept.append(p)
                except Exception as err:  # noqa: BLE001 - vLLM's own validation, before attn-otel sees it
                    rejected.append(f"{type(err).__name__}: {err}"[:200])
            t = time.monotonic()
            outs = llm.generate(kept, params, use_tqdm=False)
            elapsed = time.monotonic() - t
            llm.llm_engine.step()  # finished requests reach the worker in the next step
            out = {"elapsed_s": elapsed,
                   "outputs": [{"prompt_tokens": len(o.prompt_token_ids),
                                "output_tokens": len(o.outputs[0].token_ids),
                                "text": o.outputs[0].text, "prompt_ids": list(o.prompt_token_ids),
                                "output_ids": list(o.outputs[0].token_ids)} for o in outs],
                   "rejected_by_vllm": rejected}
        elif op == "flush":
            t = time.monotonic()
            out = {"done": cap.flush(cmd.get("timeout", 120)), "flush_s": time.monotonic() - t}
        elif op == "reset_peak":
            for pid in [os.getpid(), *writer_pids()]:
                with open(f"/proc/{pid}/clear_refs", "w") as f:
                    f.write("5")  # the peak resident set (VmHWM) starts again from the current one
        elif op == "memory":
            out = {str(pid): {"rss_kib": _kib(pid, "VmRSS:"), "hwm_kib": _kib(pid, "VmHWM:")}
                   for pid in [os.getpid(), *writer_pids()]}
        elif op == "exit":
            reply.write(json.dumps({"stats": stats()}) + "\n")
            return  # a normal interpreter exit: the capture engine's exit drain runs
        elif op != "stats":
            raise ValueError(f"unknown op {op!r}")
        out["stats"] = stats()
        reply.write(json.dumps(out) + "\n")


if __name__ == "__main__":
    main()
