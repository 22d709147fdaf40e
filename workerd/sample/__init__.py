"""From logits to tokens on the output rank: penalties, sampling and logprobs."""
