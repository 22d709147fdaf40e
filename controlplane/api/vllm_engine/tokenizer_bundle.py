"""GetTokenizer: the served model's tokenizer files as the zip the gateway rebuilds.

The gateway tokenizes, applies the chat template and detokenizes itself, so
it must have exactly kvloom's tokenizer; when it cannot load the path
GetModelInfo names (another host, no model files there) it asks for this
bundle. Format (smg-gateway.md section 3): one zip, files stored flat, sent
in chunks that are concatenated in order, the lowercase hex SHA-256 of the
whole zip on the final chunk only. The gateway refuses more than 50 entries,
200 MiB streamed or any path with '..'; this side never sends more than
MAX_BUNDLE_FILES files or MAX_BUNDLE_BYTES, so a checkpoint with odd extras
fails here with a message instead of in the gateway.

Built once, off the event loop, and kept: the files do not change while the
server runs.
"""

from __future__ import annotations

import hashlib
import io
import os
import zipfile
from dataclasses import dataclass

# vLLM's list (smg-grpc-servicer's tokenizer_bundle), plus the suffixes below.
BUNDLE_FILES = (
    "tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json",
    "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model",
    "tiktoken.model", "chat_template.json", "preprocessor_config.json",
    "processor_config.json", "video_preprocessor_config.json", "added_tokens.json",
)
BUNDLE_SUFFIXES = (".tiktoken", ".jinja")
MAX_BUNDLE_FILES = 50
MAX_BUNDLE_BYTES = 200 << 20
CHUNK_BYTES = 64 << 10


class BundleError(Exception):
    """The directory holds no tokenizer, or one too big to send."""


@dataclass(frozen=True)
class TokenizerBundle:
    data: bytes
    sha256: str
    names: tuple[str, ...]

    def chunks(self) -> list[tuple[bytes, str]]:
        """(data, sha256) pairs in order; the digest rides on the last one only."""
        parts = [self.data[i:i + CHUNK_BYTES] for i in range(0, len(self.data), CHUNK_BYTES)]
        return [(p, self.sha256 if i == len(parts) - 1 else "") for i, p in enumerate(parts)]


def bundle_names(model_dir: str) -> list[str]:
    """The tokenizer files of model_dir, flat (no subdirectory is read)."""
    try:
        entries = sorted(os.listdir(model_dir))
    except OSError as exc:
        raise BundleError(f"cannot list the model directory {model_dir!r}: {exc}") from None
    names = [n for n in entries
             if (n in BUNDLE_FILES or n.endswith(BUNDLE_SUFFIXES))
             and os.path.isfile(os.path.join(model_dir, n))]
    if not any(n in ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model")
               or n.endswith(".tiktoken") for n in names):
        raise BundleError(f"{model_dir!r} holds no tokenizer file (tokenizer.json, "
                          f"tokenizer.model, vocab.json or *.tiktoken)")
    if len(names) > MAX_BUNDLE_FILES:
        raise BundleError(f"{len(names)} tokenizer files; the gateway takes at most "
                          f"{MAX_BUNDLE_FILES}")
    return names


def build_bundle(model_dir: str) -> TokenizerBundle:
    names = bundle_names(model_dir)
    total = sum(os.path.getsize(os.path.join(model_dir, n)) for n in names)
    if total > MAX_BUNDLE_BYTES:
        raise BundleError(f"the tokenizer files total {total} bytes; the gateway takes at "
                          f"most {MAX_BUNDLE_BYTES}")
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name in names:
            zf.write(os.path.join(model_dir, name), arcname=name)
    data = buf.getvalue()
    return TokenizerBundle(data, hashlib.sha256(data).hexdigest(), tuple(names))
