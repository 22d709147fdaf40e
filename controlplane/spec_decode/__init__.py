"""Speculative decoding: drafts proposed cheaply, verified by the target model in one step.

config.py parses --speculative-config (vLLM's JSON); ngram.py proposes
prompt-lookup drafts from the token ids the controlplane already holds.
"""
