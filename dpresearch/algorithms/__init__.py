"""What happens between one backward and the next forward, written once for any worker layout."""
