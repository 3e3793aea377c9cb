package position

// The header codec: the one place that turns header values into a token
// and a token into a header value. Every stamper (asynq, kafka, outbox
// relays) and every reader (the consume router, the adapters) goes through
// these two functions, so one rule decides what an unreadable header means.

// MergeHeader returns the value of the HeaderName header that carries tok
// on top of existing, the value a task or message already has ("" when it
// has none):
//
//   - existing empty: tok encoded ("" for the zero Token: send no header).
//   - existing decodes: the two merged (Token.Merge), so the job waits for
//     every position either of them names.
//   - existing does not decode (malformed, or written by a newer version):
//     existing, unchanged, and tok is dropped. Unknown stays unknown: a
//     consumer cannot trust a header it cannot read, routes the job to the
//     primary and counts it, and the primary satisfies tok as well.
//     Replacing the unreadable value with tok alone could send the job to
//     a replica that lacks whatever the unreadable value stood for.
//
// The error is non-nil only when the merged token cannot be carried (more
// than MaxDatabases databases, an invalid database name): stampers return
// it at the call rather than send a header every consumer would reject.
func MergeHeader(existing string, tok Token) (string, error) {
	if tok.IsZero() {
		return existing, nil
	}
	if existing == "" {
		return tok.Encode()
	}
	prev, err := Decode(existing)
	if err != nil {
		return existing, nil
	}
	return prev.Merge(tok).Encode()
}

// DecodeHeaders returns the token carried by the values of a message's
// HeaderName headers. A header may repeat (Kafka allows it, and a message
// relayed by several stampers can collect more than one): the values are
// merged, as MergeHeader would have merged them. Empty values are skipped.
//
// No value (or only empty ones) returns the zero Token and nil: the job
// carries no token. If any value does not decode, DecodeHeaders returns
// the zero Token and that value's *DecodeError: one unreadable value makes
// the whole message unknown, whatever the others say, and the consumer
// reads the primary (consume.Router.RouteDecoded takes the pair as is).
func DecodeHeaders(values ...string) (Token, error) {
	var tok Token
	for _, v := range values {
		if v == "" {
			continue
		}
		t, err := Decode(v)
		if err != nil {
			return Token{}, err
		}
		tok = tok.Merge(t)
	}
	return tok, nil
}
