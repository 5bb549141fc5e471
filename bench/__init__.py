"""`make bench`: measured figures against DESIGN's targets; a table on stdout, JSON in .bench/."""
