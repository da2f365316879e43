"""GRPO's token log-probabilities through the chunked head (`units.linear_cross_entropy`)
equal the plain path's (the whole [tokens, vocab] float32 log-softmax): values, entropies
and the gradient of every parameter, with a temperature, over several chunks."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from units.causal_lm import auto_loss_chunk_size
from units.online_rl.token_logps import token_logps
from units.online_rl.window import Slice, slice_tensors

VOCAB = 301
TEMPERATURE = 0.7
# A float32 log-sum-exp over VOCAB terms rounds each partial sum: its error is at most about
# VOCAB * eps of the sum (<= 1 after the max is taken out), and the log keeps it absolute.
TOLERANCE = VOCAB * torch.finfo(torch.float32).eps


def tiny_model(tied: bool) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         tie_word_embeddings=tied)
    return LlamaForCausalLM(config).float()


def window_slice() -> Slice:
    g = torch.Generator().manual_seed(1)
    prompts = [tuple(torch.randint(3, VOCAB, (n,), generator=g).tolist()) for n in (4, 7, 2)]
    completions = [tuple(torch.randint(3, VOCAB, (n,), generator=g).tolist()) for n in (5, 3, 8)]
    ids, mask, scored = slice_tensors(prompts, completions, pad_id=0)
    return Slice(ids, mask, scored, torch.zeros(3), torch.ones(3, dtype=torch.bool))


def logps_and_grads(model, s, chunk_size):
    model.zero_grad()
    logp, entropy = token_logps(model, s, TEMPERATURE, with_entropy=True, chunk_size=chunk_size)
    # a weighted sum: every token's gradient enters with its own factor
    weights = torch.linspace(-1.0, 2.0, logp.shape[0])
    (logp * weights).sum().backward()
    return logp.detach(), entropy, {n: p.grad.clone() for n, p in model.named_parameters()}


def test_the_chunked_head_gives_the_plain_log_probs_entropies_and_gradients():
    s = window_slice()
    for tied in (False, True):
        model = tiny_model(tied)
        plain = logps_and_grads(model, s, None)
        chunked = logps_and_grads(model, s, 4)  # 16 tokens: 4 chunks
        assert plain[0].shape == (16,)
        torch.testing.assert_close(chunked[0], plain[0], rtol=0, atol=TOLERANCE)
        torch.testing.assert_close(chunked[1], plain[1], rtol=0, atol=TOLERANCE)
        for name, want in plain[2].items():
            scale = float(want.abs().max()) or 1.0
            torch.testing.assert_close(chunked[2][name], want, rtol=0, atol=TOLERANCE * scale,
                                       msg=name)


def test_auto_takes_the_plain_path_at_a_small_vocabulary():
    assert auto_loss_chunk_size(tiny_model(False)) is None  # 301 < 32768: plain
