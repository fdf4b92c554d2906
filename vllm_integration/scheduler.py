"""The scheduler of a Bitune engine: vLLM's own, except that a request preempted after it produced tokens is stopped.

vLLM resumes a preempted request by prefilling its prompt and its output so far as one new prompt. The Bitune plugin
would read all of that twice and mix it, where `generate` mixed only the prompt and read the output causally, so the
resumed answer would differ. Such a request is finished instead, with `finish_reason="error"` and one logged line
naming the cause and the fix; a request preempted before its first token is resumed as usual (its prefill is exact).
"""

from __future__ import annotations

from vllm.logger import init_logger
from vllm.v1.core.sched.scheduler import Scheduler

logger = init_logger(__name__)


class BituneScheduler(Scheduler):
    """vLLM's scheduler; a preempted request with output is failed at the next output update (see module doc)."""

    def _preempt_request(self, request, timestamp: float, drop_stale_output: bool = False) -> None:
        super()._preempt_request(request, timestamp, drop_stale_output)
        if request.num_output_tokens > 0:
            logger.error(
                "Bitune: request %s was preempted (the KV cache is full) after %d tokens; resuming would read its "
                "answer as prompt and mix it, unlike generate, so it is stopped with finish_reason='error'. Give the "
                "engine more KV cache (gpu_memory_utilization, VLLM_CPU_KVCACHE_SPACE) or fewer concurrent requests "
                "(max_num_seqs).",
                request.request_id, request.num_output_tokens,
            )
            # vLLM fails the requests of this set with FINISHED_ERROR (and tells their client) at the next
            # `update_from_output`, before they can be scheduled again.
            self.encoder_cache_mismatch_reqs.add(request.request_id)
