"""studies/study_long_documents.py in parts: its data, its runs and its report."""
