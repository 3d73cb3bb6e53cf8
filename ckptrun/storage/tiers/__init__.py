"""Tiers: the places a run's records live besides --dir (see `base.Tier`)."""

from __future__ import annotations

from .base import Tier


def is_remote(url: str) -> bool:
    return url.startswith("s3://")


def open_tier(url: str, endpoint: str | None = None) -> Tier:
    """The tier at `url`: `s3://bucket/prefix` (the s3 extra) or a plain path."""
    if is_remote(url):
        from .s3tier import S3Tier

        return S3Tier(url, endpoint)
    from .dirtier import DirTier

    return DirTier(url)
