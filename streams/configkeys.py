"""The one unknown-key check of the ledger document's tables (pricing, carbon, watch): a misspelt
key is refused by name, never ignored (a misspelt price would bill at 0)."""
from __future__ import annotations

from collections.abc import Iterable, Mapping


def refuse_unknown_keys(raw: Mapping, known: Iterable[str], where: str, error: type[ValueError]) -> None:
    """Raise `error` naming the keys of `raw` outside `known` (and the known ones)."""
    known = set(known)
    unknown = sorted(str(k) for k in set(raw) - known)
    if unknown:
        raise error(f"{where}: unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})")
