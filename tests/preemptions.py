"""Count vLLM's preemptions in this process (an in-process engine: VLLM_ENABLE_V1_MULTIPROCESSING=0)."""


def count_preemptions() -> list[str]:
    """Wrap the v1 scheduler's ``_preempt_request``; the returned list fills with the preempted request ids."""
    from vllm.v1.core.sched import scheduler as sched

    preempted: list[str] = []
    orig = sched.Scheduler._preempt_request

    def counting(self, request, *args, **kwargs):
        preempted.append(request.request_id)
        return orig(self, request, *args, **kwargs)

    sched.Scheduler._preempt_request = counting
    return preempted
