"""What chv-broker and chv-browser share: the framing of a request and a
reply and the per-slot quotas (wire), the table of operations and browser
actions (protocol)."""
