"""Two threads calling one Bitune model. Each pass routes the model's layers to a weight set, which is the model's own
state, so a call waits for another thread's call to end (`routing.one_call_at_a_time`): each thread gets the answer
it gets alone, where before a pass could run with the other thread's weight set, without a word."""

from __future__ import annotations

import threading
from collections import Counter

import torch

from reference import left_padded, make_bitune
from tiny_models import VOCAB

WAIT = 1.0  # seconds a paused pass waits for the other thread: the whole wait where the calls take turns


def test_a_generate_on_another_thread_waits_for_the_running_one_and_each_gets_its_own_answer(load_base):
    model = make_bitune(load_base("llama")).eval()
    generator = torch.Generator().manual_seed(0)
    prompts = {
        name: left_padded([torch.randint(3, VOCAB, (length,), generator=generator) for length in lengths])
        for name, lengths in (("a", (6, 4)), ("b", (5, 7)))
    }
    settings = dict(max_new_tokens=4, do_sample=False, output_scores=True, return_dict_in_generate=True)
    alone = {name: model.generate(**batch, **settings) for name, batch in prompts.items()}

    # The one interleaving that routes one thread's pass with the other's weights, forced with pre-hooks: B stops at
    # the first layer of its bidirectional prompt pass until A is inside its causal prompt pass, which then waits for
    # B to reach the last layer. Calls that take turns pass through both hooks with at most one wait of WAIT.
    b_inside, a_inside, b_past = threading.Event(), threading.Event(), threading.Event()
    calls = Counter()

    def at_first_layer(module, args):
        thread = threading.current_thread().name
        calls[thread] += 1
        if thread == "b" and calls[thread] == 1:  # B's bidirectional prompt pass
            b_inside.set()
            a_inside.wait(WAIT)
        elif thread == "a" and calls[thread] == 2:  # A's causal prompt pass (after its bidirectional one)
            a_inside.set()
            b_past.wait(WAIT)

    def at_last_layer(module, args):
        if threading.current_thread().name == "b":
            b_past.set()

    layers = model.get_base_model().model.layers
    handles = [layers[0].register_forward_pre_hook(at_first_layer),
               layers[-1].register_forward_pre_hook(at_last_layer)]
    results = {}

    def generate(name):
        results[name] = model.generate(**prompts[name], **settings)

    threads = {name: threading.Thread(target=generate, args=(name,), name=name) for name in ("b", "a")}
    try:
        threads["b"].start()
        assert b_inside.wait(10 * WAIT)
        threads["a"].start()
        for thread in threads.values():
            thread.join(20 * WAIT)
    finally:
        for handle in handles:
            handle.remove()
    assert sorted(results) == ["a", "b"]
    for name, want in alone.items():
        assert torch.equal(results[name].sequences, want.sequences), name
        torch.testing.assert_close(torch.stack(results[name].scores), torch.stack(want.scores), msg=name)
