"""At a large vocabulary the preference units run the head on the answer tokens only, in
chunks (`linear_log_probs`): the rows' summed log-probabilities, and their gradients, are
those of the full head."""

import torch
import torch.nn.functional as F
from tolerances import reordered_sum_rtol
from transformers import LlamaConfig, LlamaForCausalLM

from units.causal_lm import AUTO_MIN_VOCAB, auto_loss_chunk_size
from units.preference import side_logps


def test_answer_token_head_gives_the_full_heads_logps_and_gradients():
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=AUTO_MIN_VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
        use_cache=False))
    assert auto_loss_chunk_size(model) is not None  # the answer-token path is taken
    ids = torch.randint(0, AUTO_MIN_VOCAB, (4, 24))
    labels = ids.clone()
    labels[:, :10] = -100  # the prompts
    labels[1, 20:] = -100  # a shorter answer
    batch = {"input_ids": ids, "labels": labels}
    logps, counts = side_logps(model, batch)
    logps.sum().backward()
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    # The reference: the full head, every position's log-softmax, answers summed by hand.
    logits = model(ids, use_cache=False).logits[:, :-1]
    targets = labels[:, 1:]
    nll = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none",
                          ignore_index=-100).view(targets.shape)
    expected = -nll.sum(-1)
    expected.sum().backward()
    assert counts.tolist() == (targets != -100).sum(-1).tolist()
    # reason: a row's log-prob is a float32 sum of its answer tokens' log-probs (all < 0: a
    # relative bound), summed in another order by the chunked head; each term is a
    # log-softmax whose vocabulary sum (pairwise, log2(V) roundings of an O(1) sum) and final
    # rounding add ~2 roundings of |log-prob| ~ log V: two more terms' worth.
    rtol = reordered_sum_rtol(int(counts.max()) + 2)
    torch.testing.assert_close(logps, expected, rtol=rtol, atol=0)
    # reason: every gradient sums the answer tokens' contributions (softmax - one-hot through
    # the head) over the whole batch, in chunks here: float32 in another order, relative to
    # the largest entry
    grad_rtol = reordered_sum_rtol(int(counts.sum()))
    for g, p in zip(got, model.parameters(), strict=True):
        assert (g - p.grad).abs().max().item() <= grad_rtol * p.grad.abs().max().item()
