package position

import (
	"errors"
	"strconv"
)

// Sentinel causes of a rejected token, for errors.Is. Decode wraps each in
// a *DecodeError that says where the input went wrong.
var (
	// ErrMalformed: the text does not follow the token grammar.
	ErrMalformed = errors.New("malformed token")
	// ErrUnknownVersion: a version this build cannot read; upgrade the
	// consumer or keep producers on the older format until it is.
	ErrUnknownVersion = errors.New("unknown token version")
	// ErrTooLarge: longer than MaxEncodedLen or more than MaxDatabases
	// entries; tokens are header values and must stay small.
	ErrTooLarge = errors.New("token too large")
	// ErrDuplicateDatabase: two entries name the same database, so the
	// token does not say which position applies.
	ErrDuplicateDatabase = errors.New("duplicate database in token")
)

// DecodeError reports why a token was rejected.
type DecodeError struct {
	// Offset is the byte offset in the input where decoding failed.
	Offset int
	// Err is one of the sentinel errors above.
	Err error
	// Detail says what was expected there.
	Detail string
	// Input is a bounded excerpt (at most 64 bytes, around Offset) of
	// the rejected text, as Decode received it; Error prints it escaped.
	// Empty for errors of Encode.
	Input string
}

func (e *DecodeError) Error() string {
	s := "caughtup/position: " + e.Err.Error() + " at byte " + strconv.Itoa(e.Offset)
	if e.Detail != "" {
		s += ": " + e.Detail
	}
	if e.Input != "" {
		s += " in " + strconv.QuoteToASCII(e.Input)
	}
	return s
}

func (e *DecodeError) Unwrap() error { return e.Err }

// SyntaxError reports malformed text for an LSN or a timeline history line.
type SyntaxError struct {
	What  string
	Input string
}

func (e *SyntaxError) Error() string {
	in := e.Input
	if len(in) > 64 {
		in = in[:64] + "…"
	}
	msg := "caughtup/position: invalid " + e.What + " " + strconv.Quote(in)
	if e.What == "LSN" {
		msg += `: want two hexadecimal halves "X/Y" of at most 8 digits each`
	}
	return msg
}
