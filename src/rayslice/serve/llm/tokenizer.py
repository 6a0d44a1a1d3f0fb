"""A byte-level tokenizer and the chat template (pure Python, offline, nothing downloaded).

Token ids 0-255 are the bytes of the UTF-8 text; three special tokens follow:
``<|endoftext|>`` (256, end of a document), ``<|im_start|>`` (257) and
``<|im_end|>`` (258), which delimit chat messages. Text is always encoded as
bytes, so a user who types ``<|im_end|>`` gets those ten bytes, never the
special token: the chat template cannot be forged from inside a message.

Chat template (ChatML, documented in ``docs/llm.md``)::

    <|im_start|>system\\n{content}<|im_end|>\\n      (one per message, in order)
    <|im_start|>user\\n{content}<|im_end|>\\n
    <|im_start|>assistant\\n                         (the generation prompt)

Generation stops at ``<|endoftext|>`` or ``<|im_end|>``.

Example:
    >>> tok = ByteTokenizer()
    >>> tok.encode("hé")
    [104, 195, 169]
    >>> tok.decode([104, 195, 169, 256])
    'hé'
    >>> ids = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    >>> tok.decode(ids, skip_special_tokens=False)
    '<|im_start|>user\\nhi<|im_end|>\\n<|im_start|>assistant\\n'
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable, Mapping, Sequence

EOS_ID = 256
IM_START_ID = 257
IM_END_ID = 258
SPECIAL_TOKENS = {EOS_ID: "<|endoftext|>", IM_START_ID: "<|im_start|>", IM_END_ID: "<|im_end|>"}
ROLES = ("system", "user", "assistant")


class ByteTokenizer:
    """UTF-8 bytes plus three special tokens; ``vocab_size`` is 259."""

    vocab_size = 259
    eos_id = EOS_ID
    im_start_id = IM_START_ID
    im_end_id = IM_END_ID
    stop_ids = (EOS_ID, IM_END_ID)

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of ``text`` (special-token names are plain text here)."""
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; invalid UTF-8 becomes U+FFFD, special tokens are dropped unless asked for."""
        out, buf = [], bytearray()
        for i in ids:
            if 0 <= i < 256:
                buf.append(i)
                continue
            out.append(buf.decode("utf-8", errors="replace"))
            buf = bytearray()
            if not skip_special_tokens and i in SPECIAL_TOKENS:
                out.append(SPECIAL_TOKENS[i])
        out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True
    ) -> list[int]:
        """Token ids of a conversation in the ChatML template (see the module docstring)."""
        ids: list[int] = []
        for m in messages:
            ids += [IM_START_ID, *self.encode(f"{m['role']}\n{m['content']}"), IM_END_ID, *self.encode("\n")]
        if add_generation_prompt:
            ids += [IM_START_ID, *self.encode("assistant\n")]
        return ids


class IncrementalDecoder:
    """Token ids in, text out as soon as it is complete UTF-8 (streaming).

    Example:
        >>> d = IncrementalDecoder()
        >>> d.feed(195), d.feed(169), d.flush()
        ('', 'é', '')
    """

    def __init__(self) -> None:
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        if 0 <= token_id < 256:
            return self._dec.decode(bytes([token_id]))
        return ""  # special tokens carry no text

    def flush(self) -> str:
        return self._dec.decode(b"", final=True)


class StopMatcher:
    """Holds back text that could be the start of a stop string; finds the first stop.

    ``feed(text)`` returns ``(safe_text, stopped)``: text that can be sent now
    and whether a stop string was completed (the stop string and anything after
    it are never returned). ``flush()`` returns the held-back rest at the end.

    Example:
        >>> m = StopMatcher(["\\n\\n"])
        >>> m.feed("ab\\n"), m.feed("c\\n"), m.feed("\\nzz")
        (('ab', False), ('\\nc', False), ('', True))
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self._held = ""
        self.stopped = False

    def feed(self, text: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        buf = self._held + text
        first = min((i for i in (buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if first >= 0:
            self.stopped, self._held = True, ""
            return buf[:first], True
        keep = 0  # the longest suffix of buf that is a proper prefix of some stop string
        for s in self.stops:
            for n in range(min(len(s) - 1, len(buf)), keep, -1):
                if buf.endswith(s[:n]):
                    keep = n
                    break
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        out, self._held = ("" if self.stopped else self._held), ""
        return out
