"""Execute a plan: write the stage directories crash-safe and resumable (``writer``), and mend a
damaged split from its source (``repair``)."""
