"""Developer tools of the source checkout (not shipped in the wheel); import from the repository root."""
