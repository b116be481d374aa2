"""Optional bridges to other trainers (Lightning); each module is imported only when asked for."""
