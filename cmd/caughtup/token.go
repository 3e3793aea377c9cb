package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/caughtup/caughtup/position"
)

func runToken(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	if len(args) == 0 || args[0] == "-h" || args[0] == "--help" {
		fmt.Fprintln(stdout, "usage: caughtup token <decode|encode> [flags]\n\n  decode  print a token as indented JSON (reads stdin when no argument is given)\n  encode  build a token from flags and print its text form")
		if len(args) == 0 {
			return usageError{"missing subcommand: decode or encode"}
		}
		return nil
	}
	switch args[0] {
	case "decode":
		return tokenDecode(args[1:], stdout)
	case "encode":
		return tokenEncode(args[1:], stdout)
	}
	return usageError{fmt.Sprintf("unknown subcommand %q: want decode or encode", args[0])}
}

// decodedToken is the JSON shape of 'token decode': the token plus the
// facts an operator asks first.
type decodedToken struct {
	Version    int              `json:"version"`
	CapturedAt *time.Time       `json:"captured_at,omitempty"`
	Age        string           `json:"age,omitempty"`
	Entries    []position.Entry `json:"entries"`
}

func tokenDecode(args []string, stdout io.Writer) error {
	fs := newFlagSet("token decode [token]\n\nPrints the token as indented JSON. Without an argument the token is read from stdin.\nA malformed token exits with status 2 and a one-line error.", stdout)
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	var text string
	switch fs.NArg() {
	case 0:
		b, err := io.ReadAll(io.LimitReader(bufio.NewReader(os.Stdin), position.MaxEncodedLen+2))
		if err != nil {
			return err
		}
		text = strings.TrimRight(string(b), "\r\n")
	case 1:
		text = fs.Arg(0)
	default:
		return usageError{"want one token"}
	}
	tok, err := position.Decode(text)
	if err != nil {
		// One line, whatever the input held: the error quotes nothing
		// from the input but the reason and offset.
		return usageError{oneLine(err.Error())}
	}
	out := decodedToken{Version: position.Version, Entries: tok.Entries}
	if !tok.CapturedAt.IsZero() {
		at := tok.CapturedAt.UTC()
		out.CapturedAt = &at
		out.Age = time.Since(at).Round(time.Millisecond).String()
	}
	enc := json.NewEncoder(stdout)
	enc.SetIndent("", "  ")
	return enc.Encode(out)
}

func oneLine(s string) string {
	return strings.Map(func(r rune) rune {
		if r < ' ' || r == 0x7f {
			return ' '
		}
		return r
	}, s)
}

func tokenEncode(args []string, stdout io.Writer) error {
	fs := newFlagSet("token encode --database NAME --system-id ID --timeline N --lsn X/Y [--source primary] [--captured-at RFC3339]", stdout)
	db := fs.String("database", "main", "logical database name")
	sys := fs.String("system-id", "", "system identifier (decimal, from pg_control_system())")
	tli := fs.Uint("timeline", 1, "timeline ID")
	lsnText := fs.String("lsn", "", `WAL position "X/Y"`)
	src := fs.String("source", "primary", "primary, replica, cdc or unknown")
	at := fs.String("captured-at", "", "capture time (RFC 3339; default now)")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if fs.NArg() != 0 {
		return usageError{"unexpected argument " + strconv.Quote(fs.Arg(0))}
	}
	switch {
	case *sys == "" && *lsnText == "":
		return usageError{"--system-id and --lsn are required: the token's cluster and WAL position"}
	case *sys == "":
		return usageError{"--system-id is required: the cluster's system identifier (SELECT system_identifier FROM pg_control_system())"}
	case *lsnText == "":
		return usageError{`--lsn is required: the WAL position "X/Y" (SELECT pg_current_wal_insert_lsn() on the primary)`}
	}
	sysID, err := strconv.ParseUint(*sys, 10, 64)
	if err != nil {
		return usageError{"--system-id " + strconv.Quote(*sys) + ": want a decimal number (pg_control_system().system_identifier)"}
	}
	lsn, err := position.ParseLSN(*lsnText)
	if err != nil {
		return usageError{"--lsn: " + err.Error()}
	}
	var source position.Source
	if err := source.UnmarshalText([]byte(*src)); err != nil {
		return usageError{"--source: want primary, replica, cdc or unknown"}
	}
	when := time.Now()
	if *at != "" {
		if when, err = time.Parse(time.RFC3339Nano, *at); err != nil {
			return usageError{"--captured-at: " + err.Error()}
		}
	}
	if *tli == 0 || *tli > 1<<32-1 {
		return usageError{"--timeline: want 1 to 4294967295"}
	}
	tok := position.New(*db, position.Epoch{SystemID: sysID, Timeline: uint32(*tli)}, lsn, source, when)
	s, err := tok.Encode()
	if err != nil {
		var de *position.DecodeError
		if errors.As(err, &de) {
			return usageError{err.Error()}
		}
		return err
	}
	_, err = fmt.Fprintln(stdout, s)
	return err
}
