"""ipywidgets views with static HTML/text fallbacks; arrive with the kernel issue."""
