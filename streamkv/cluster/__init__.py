"""Session-affine streamkv replicas on Ray Serve (``streamkv serve --replicas N``).

::

    client ──HTTP/SSE/WS──▶ Ray Serve HTTP ingress (HAProxy where installed)
                               │
                               ▼
                  ClusterIngress (one Serve replica): Proxy + Router
                  ├─ stateless routes ─▶ least-loaded replica (in flight + waiting, KV free)
                  ├─ /v1/sessions/{id}… ─▶ owner: override table (Ray actor) or hash ring
                  └─ migrate / drain / failover: release on the source, adopt on the target
                               │ HTTP (loopback or node IP)
              ┌────────────────┼────────────────┐
              ▼                ▼                ▼
        replica-0          replica-1   …   replica-N-1     one streamkv engine + server each
              └──────── shared --session-dir (snapshots + push logs) ───────┘

Only ``config``, ``ring`` and ``routing`` import without Ray; the rest needs ``streamkv[cluster]``.
"""
