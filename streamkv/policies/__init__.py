"""KV policies (DESIGN.md section 5): plug-ins that choose which cached tokens are used."""
from __future__ import annotations

from streamkv.policies.read import (READ_POLICIES, PagePlan, QuestPolicy, ReadCount, ReadPolicy, RecentPolicy,
                                   SpanSlots, make_read_policy)
from streamkv.policies.write import (WRITE_POLICIES, KVLayout, SnapStreamPolicy, StreamingLLMPolicy, WritePolicy,
                                    make_write_policy)

__all__ = ["READ_POLICIES", "PagePlan", "QuestPolicy", "ReadPolicy", "RecentPolicy", "SpanSlots", "make_read_policy", "ReadCount",
           "WRITE_POLICIES", "KVLayout", "SnapStreamPolicy", "StreamingLLMPolicy", "WritePolicy", "make_write_policy"]
