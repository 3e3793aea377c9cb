package feed

// Internals that the external tests need to play the attacker.

func ValueKeyForTest(feed, publisher string, o *Observation) string {
	return valueKey(feed, publisher, o)
}

func IndexKeyForTest(feed string) string { return indexKey(feed) }
