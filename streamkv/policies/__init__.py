"""KV policies (DESIGN.md section 5): plug-ins that choose which cached tokens are used."""
from __future__ import annotations

from streamkv.policies.read import (READ_POLICIES, PagePlan, QuestPolicy, ReadPolicy, RecentPolicy, SpanSlots,
                                   make_read_policy)

__all__ = ["READ_POLICIES", "PagePlan", "QuestPolicy", "ReadPolicy", "RecentPolicy", "SpanSlots", "make_read_policy"]
