"""`grouprl view`: a read-only local server over run folders and its pages (curves, each step's
groups, a trajectory's turns with the pages it saw, judge calls, held-out answers)."""
