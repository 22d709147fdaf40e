"""Grammar masks on the output rank: the mailbox they arrive in and their decoding.

The controlplane keeps each constrained request's grammar matcher (structured
outputs) and, once it knows a step's masks, sends the output rank alone a
GrammarMasks command: one TokenMask per id in that step's
SchedulerOutput.constrained_req_ids. It has no reply and does not queue
behind the running command: the stream reader files it in the GrammarMaskBox
at once, because the main thread may already be blocked in take() for it
(async scheduling sends a step before its masks are known, so its forward
runs meanwhile). The runner then decodes the step's masks into one bool row
of allowed tokens per constrained request for the sampler.

This is the masks' wire edge (as workerd/wire.py is the step's): it reads
worker_pb2 messages so that nothing past it does. Decoding fails closed: a
mask that is malformed, names an id outside the vocabulary or allows no
token at all raises ValueError, and the step fails with a WorkerError; a
broken mask is never read as "anything goes". No grammar library is needed
here: a bitmask row unpacks with torch shifts.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

import numpy as np
import torch

from kvloom.worker.v1 import worker_pb2

logger = logging.getLogger(__name__)

# Steps whose masks the box holds at most. The controlplane keeps a handful of
# steps in flight (async scheduling: 3), so more means masks nobody takes.
MAX_HELD_STEPS = 64

# bit j of a little-endian int32 word (an arithmetic shift keeps bit j where
# it is, whatever the sign).
_BIT_SHIFTS = torch.arange(32, dtype=torch.int32)


class GrammarMasksMissing(RuntimeError):
    """A step's grammar masks did not arrive: the wait timed out or was aborted."""


def decode_token_masks(masks: Sequence[worker_pb2.TokenMask], vocab_size: int,
                       device: torch.device | str = "cpu") -> torch.Tensor:
    """[len(masks), vocab_size] bool on `device`, True = the token may be sampled.

    A bitmask is exactly ceil(vocab_size / 32) little-endian int32 words, bit
    j of word i allowing token 32 * i + j; its bits past vocab_size are
    ignored. Listed ids must be below vocab_size. ValueError, naming the mask,
    for a mask with nothing set, a bitmask of another length, an id out of
    range, unconstrained=false, or a mask that allows no token."""
    num_words = -(-vocab_size // 32)
    allowed = torch.zeros((len(masks), vocab_size), dtype=torch.bool)
    bitmask_rows: list[int] = []
    bitmask_bytes: list[bytes] = []
    for i, mask in enumerate(masks):
        kind = mask.WhichOneof("mask")
        if kind == "bitmask":
            if len(mask.bitmask) != 4 * num_words:
                raise ValueError(
                    f"grammar mask {i}: a bitmask of {len(mask.bitmask)} bytes, expected "
                    f"{4 * num_words} (ceil({vocab_size} / 32) int32 words)")
            bitmask_rows.append(i)
            bitmask_bytes.append(mask.bitmask)
        elif kind == "allowed":
            allowed[i, _token_ids(mask.allowed.ids, vocab_size, i)] = True
        elif kind == "disallowed":
            allowed[i] = True
            allowed[i, _token_ids(mask.disallowed.ids, vocab_size, i)] = False
        elif kind == "unconstrained":
            if not mask.unconstrained:
                raise ValueError(f"grammar mask {i}: unconstrained is set to false")
            allowed[i] = True
        else:
            raise ValueError(f"grammar mask {i} is empty (no bitmask, allowed, disallowed "
                             f"or unconstrained)")
    if bitmask_rows:
        allowed[bitmask_rows] = _unpack_bitmasks(bitmask_bytes, num_words, vocab_size)
    empty = ~allowed.any(dim=-1)
    if empty.any():
        raise ValueError(f"grammar mask {int(empty.nonzero()[0])} allows no token")
    return allowed.to(device)


def _unpack_bitmasks(rows: list[bytes], num_words: int, vocab_size: int) -> torch.Tensor:
    """[len(rows), vocab_size] bool from rows of num_words little-endian int32 words."""
    words = np.frombuffer(b"".join(rows), dtype="<i4").astype(np.int32)  # native order
    words_t = torch.from_numpy(words).view(len(rows), num_words, 1)
    bits = (words_t >> _BIT_SHIFTS) & 1  # [rows, words, 32]
    return bits.view(len(rows), num_words * 32)[:, :vocab_size].bool()


def _token_ids(ids, vocab_size: int, i: int) -> torch.Tensor:
    out = torch.from_numpy(np.asarray(ids, dtype=np.int64))
    if out.numel() and int(out.max()) >= vocab_size:
        raise ValueError(f"grammar mask {i}: token id {int(out.max())} is outside the "
                         f"vocabulary of {vocab_size}")
    return out


class GrammarMaskBox:
    """Where GrammarMasks wait for the step that samples with them.

    put() is called on the stream reader's thread, take() on the main thread
    (the output rank's sampling), abort() by the reader when the group fails
    under a running command (Reset) or the stream ends, clear() by Reset.
    Steps are taken in order, so masks of a step older than the last one
    taken are stale and dropped; at most max_steps steps are held (the oldest
    goes first).
    """

    def __init__(self, max_steps: int = MAX_HELD_STEPS) -> None:
        self.max_steps = max_steps
        self._cond = threading.Condition()
        self._masks: dict[int, worker_pb2.GrammarMasks] = {}
        self._last_taken = -1
        # Why waits end at once now (None: they wait).
        self._aborted: str | None = None

    def put(self, msg: worker_pb2.GrammarMasks) -> None:
        with self._cond:
            step_id = msg.step_id
            if step_id <= self._last_taken:
                logger.warning("dropped the grammar masks of step %d: step %d was sampled "
                               "already", step_id, self._last_taken)
                return
            if step_id in self._masks:
                logger.warning("grammar masks of step %d sent twice; the later ones count",
                               step_id)
            self._masks[step_id] = msg
            while len(self._masks) > self.max_steps:
                oldest = min(self._masks)
                del self._masks[oldest]
                logger.warning("dropped the grammar masks of step %d: more than %d steps held",
                               oldest, self.max_steps)
            self._cond.notify_all()

    def take(self, step_id: int, timeout_s: float) -> worker_pb2.GrammarMasks:
        """Step `step_id`'s masks, waiting up to timeout_s for them to arrive;
        GrammarMasksMissing when they do not or the wait is aborted."""
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        with self._cond:
            while (msg := self._masks.pop(step_id, None)) is None:
                waited = time.monotonic() - t0
                if self._aborted is not None:
                    raise GrammarMasksMissing(
                        f"step {step_id}: the wait for its grammar masks was aborted after "
                        f"{waited:.3g} s ({self._aborted})")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise GrammarMasksMissing(
                        f"step {step_id}: its grammar masks did not arrive within "
                        f"{timeout_s:g} s")
                self._cond.wait(left)
            self._last_taken = max(self._last_taken, step_id)
            for stale in [s for s in self._masks if s < step_id]:
                del self._masks[stale]
            return msg

    def abort(self, reason: str) -> None:
        """Every wait, now and until clear(), ends with GrammarMasksMissing."""
        with self._cond:
            self._aborted = reason
            self._cond.notify_all()

    def clear(self) -> None:
        """Reset: forget every mask and abort; the next group's step ids start afresh."""
        with self._cond:
            self._masks.clear()
            self._last_taken = -1
            self._aborted = None

    def __len__(self) -> int:
        with self._cond:
            return len(self._masks)
