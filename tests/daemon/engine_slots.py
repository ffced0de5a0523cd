"""An engine's adapter slots without a model: the half of the engine that the adapter manager and
the training loop drive, for fast tests of their decisions (the slow tier runs a real engine)."""

from __future__ import annotations


class Slots:
    """An engine's adapter slots: what is loaded and what new requests go to."""

    def __init__(self) -> None:
        self.loaded: list[str] = []
        self.active: str | None = None

    async def load_adapter(self, version: str, path: str) -> None:
        self.loaded.append(version)

    async def activate(self, version: str | None) -> None:
        assert version is None or version in self.loaded, f"{version} activated before it was loaded"
        self.active = version

    async def unload(self, version: str) -> None:
        self.loaded.remove(version)

    def active_version(self) -> str | None:
        return self.active

    def loaded_versions(self) -> list[str]:
        return list(self.loaded)
