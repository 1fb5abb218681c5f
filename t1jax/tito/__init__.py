"""Token-in-token-out: trajectory stitching, boundary repair, drift audit, routing alignment.

Entry points: `assembler.assemble(trajectory, reward, tokenizer) -> list[Sample]` (or
`assemble_trajectory` for the boundary records and summed audit too), `audit.audit_metrics(samples)`.
Records: `types.Turn`, `Segment`, `Trajectory`, `Sample`, `AuditCounts`, `BoundaryRecord`.
"""
