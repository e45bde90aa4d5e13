"""What the proxy knows of the ranks and does to them: table, feeds, recovery, coordination."""
