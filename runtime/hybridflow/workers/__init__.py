"""Worker roles as plain classes; the scheduler hosts them in Ray actors."""
