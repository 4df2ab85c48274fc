"""``auto``: a route per replica by device (sender, the plan, the workers' device report)."""
