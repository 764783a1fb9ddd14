"""Prompt lookup (n-gram) proposer: find the latest earlier occurrence of the text's last n tokens and
propose the tokens that followed it. Costs no model call; wins on outputs that copy their input."""

from __future__ import annotations

import numpy as np


class NgramProposer:
    cheap = True

    def __init__(self, max_n: int = 4, min_n: int = 2, window: int = 2048):
        if not 1 <= min_n <= max_n:
            raise ValueError("need 1 ≤ min_n ≤ max_n")
        self.max_n, self.min_n, self.window = max_n, min_n, window

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens; the longest matching suffix (max_n down to min_n) wins, the latest match first."""
        if k <= 0 or len(tokens) <= self.min_n:
            return []
        text = np.asarray(tokens[-self.window:], dtype=np.int64)
        size = text.shape[0]
        for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
            tail = text[size - n:]
            # candidate starts i with text[i:i+n] == tail and i + n < size (something follows the match)
            starts = np.flatnonzero(text[: size - n] == tail[0])
            for i in starts[::-1]:
                if i + n < size and np.array_equal(text[i:i + n], tail):
                    return [int(t) for t in text[i + n:i + n + k]]
        return []
