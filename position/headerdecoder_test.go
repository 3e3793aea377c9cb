package position

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"reflect"
	"strings"
	"testing"
	"time"
)

// sameDecoding fails t unless HeaderDecoder's answer for s equals
// DecodeHeaders's: the same token, or the same error; and, to the byte,
// the answer of the decoder it replaced (decode_ref_test.go).
func sameDecoding(t testing.TB, h *HeaderDecoder, s string) {
	t.Helper()
	want, wantErr := DecodeHeaders(s)
	got, err := h.Decode([]byte(s))
	if s != "" {
		ref, refErr := refDecode(s)
		sameAsReference(t, "HeaderDecoder.Decode", []byte(s), got, err, ref, refErr)
	}
	if (err == nil) != (wantErr == nil) {
		t.Fatalf("Decode(%q) = %v, DecodeHeaders = %v", s, err, wantErr)
	}
	if err != nil {
		var de, wantDE *DecodeError
		if !errors.As(err, &de) || !errors.As(wantErr, &wantDE) || *de != *wantDE {
			t.Fatalf("Decode(%q) = %#v, DecodeHeaders = %#v", s, err, wantErr)
		}
	}
	if len(got.Entries) != len(want.Entries) || (len(got.Entries) > 0 && !reflect.DeepEqual(got.Entries, want.Entries)) ||
		!got.CapturedAt.Equal(want.CapturedAt) {
		t.Fatalf("Decode(%q) = %+v, DecodeHeaders = %+v", s, got, want)
	}
}

// A HeaderDecoder answers as DecodeHeaders does, whatever it decoded
// before: valid values, malformed ones, the same value twice in a row,
// and names it has seen before.
func TestHeaderDecoderAgreesWithDecodeHeaders(t *testing.T) {
	t.Parallel()
	main1, _ := New("main", tl1, 0x100, SourcePrimary, t0).Encode()
	main2, _ := New("main", tl2, 0x200, SourceReplica, t0.Add(3)).Encode()
	two, _ := Of(t0, Entry{Database: "main", Epoch: tl2, LSN: 0x300, Source: SourcePrimary},
		Entry{Database: "billing", Epoch: tl1, LSN: 0x50, Source: SourceCDC}).Encode()
	values := []string{
		main1, main1, main2, "", two, two, main1,
		"v1;0;main=p.1.1.0/1;main=p.1.1.0/2", // duplicate
		"v1;0;main=p.1.1.0/1;main=p.1.1.0/2",
		"v2;0;main=p.1.1.0/1", "garbage", main2, "v1;0;main=p.1.1.0/1\x00\n\"evil\"",
		"v1;0;" + strings.Repeat("a=p.1.1.0/1;", 100), tooManyDatabases(), two, main1,
	}
	for i := range MaxDatabases + 4 { // more names than the decoder keeps
		values = append(values, fmt.Sprintf("v1;0;d%d=p.1.1.0/%x", i, i), main1)
	}
	var h HeaderDecoder
	for _, s := range values {
		sameDecoding(t, &h, s)
	}
}

// A long run of values like a consumer sees (tokens of one to three
// databases from a few systems and timelines, capture times of varying
// length, some values repeated, some with one byte changed or cut) is
// decoded by one HeaderDecoder exactly as by DecodeHeaders: what it
// remembers of the value before never changes an answer.
func TestHeaderDecoderRun(t *testing.T) {
	t.Parallel()
	rng := rand.New(rand.NewPCG(3, 5))
	names := []string{"main", "billing", "ci", "main2"}
	epochs := []Epoch{tl1, tl2, {SystemID: 0xabc, Timeline: 1}, {SystemID: 0xabc, Timeline: 0x10}}
	var h HeaderDecoder
	prev := ""
	for range 20000 {
		var s string
		switch rng.IntN(10) {
		case 0:
			s = prev
		default:
			var es []Entry
			for _, i := range rng.Perm(len(names))[:1+rng.IntN(3)] {
				es = append(es, Entry{Database: names[i], Epoch: epochs[rng.IntN(len(epochs))],
					LSN: LSN(rng.Uint64() >> rng.IntN(64)), Source: Source(rng.IntN(4))})
			}
			s, _ = Of(time.UnixMilli(rng.Int64N(1<<45)), es...).Encode()
		}
		if s != "" && rng.IntN(4) == 0 {
			b := []byte(s)
			switch i := rng.IntN(len(b)); rng.IntN(3) {
			case 0:
				b[i] = "0aF.;=/pz"[rng.IntN(9)]
			case 1:
				b = b[:i]
			default:
				b = append(b[:i:i], append([]byte("0"), b[i:]...)...)
			}
			s = string(b)
		}
		sameDecoding(t, &h, s)
		prev = s
	}
}

// Decoding values that name databases the decoder has seen allocates
// nothing, even when every value is new.
func TestHeaderDecoderDoesNotAllocate(t *testing.T) {
	values := make([][]byte, 64)
	for i := range values {
		s, _ := Of(t0, Entry{Database: "main", Epoch: tl1, LSN: LSN(0x1000 + i), Source: SourcePrimary},
			Entry{Database: "billing", Epoch: tl1, LSN: LSN(0x50 + i), Source: SourcePrimary}).Encode()
		values[i] = []byte(s)
	}
	var h HeaderDecoder
	_, _ = h.Decode(values[0])
	i := 0
	allocs := testing.AllocsPerRun(1000, func() {
		i++
		if tok, err := h.Decode(values[i%len(values)]); err != nil || len(tok.Entries) != 2 {
			t.Fatal(tok, err)
		}
	})
	if allocs != 0 {
		t.Fatalf("%v allocations per Decode", allocs)
	}
}

// BenchmarkHeaderDecoder decodes a new value each time, as a consumer of
// messages that each carry their own token does; BenchmarkDecode is the
// same text through Decode.
func BenchmarkHeaderDecoder(b *testing.B) {
	values := make([][]byte, 4096)
	for i := range values {
		s, _ := New("main", tl1, MustParseLSN("16/B374D848")-LSN(i), SourcePrimary, t0).Encode()
		values[i] = []byte(s)
	}
	benchmarkHeaderDecoder(b, values)
}

// BenchmarkHeaderDecoderNewTimes is BenchmarkHeaderDecoder with a capture
// time of its own in every value (a millisecond apart), as records from
// producers that commit less often than once a millisecond carry.
func BenchmarkHeaderDecoderNewTimes(b *testing.B) {
	values := make([][]byte, 4096)
	for i := range values {
		s, _ := New("main", tl1, MustParseLSN("16/B374D848")-LSN(i), SourcePrimary, t0.Add(time.Duration(i)*time.Millisecond)).Encode()
		values[i] = []byte(s)
	}
	benchmarkHeaderDecoder(b, values)
}

// BenchmarkHeaderDecoderTwoDatabases decodes values of two entries, each
// value with positions and a capture time of its own; the second entry's
// head moves when the first's LSN changes length.
func BenchmarkHeaderDecoderTwoDatabases(b *testing.B) {
	values := make([][]byte, 4096)
	for i := range values {
		s, _ := Of(t0.Add(time.Duration(i)*time.Millisecond),
			Entry{Database: "billing", Epoch: tl2, LSN: LSN(0xFF0 + i), Source: SourceCDC},
			Entry{Database: "main", Epoch: tl1, LSN: MustParseLSN("16/B374D848") - LSN(i), Source: SourcePrimary}).Encode()
		values[i] = []byte(s)
	}
	benchmarkHeaderDecoder(b, values)
}

func benchmarkHeaderDecoder(b *testing.B, values [][]byte) {
	var h HeaderDecoder
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		if _, err := h.Decode(values[i%len(values)]); err != nil {
			b.Fatal(err)
		}
		i++
	}
}

// BenchmarkHeaderDecoderRepeat decodes the same value again and again, as
// a run of records that share a token (one transaction's events, an
// outbox relay's batch) gives it.
func BenchmarkHeaderDecoderRepeat(b *testing.B) {
	s, _ := New("main", tl1, MustParseLSN("16/B374D848"), SourcePrimary, t0).Encode()
	benchmarkHeaderDecoder(b, [][]byte{[]byte(s)})
}

// commonPrefix finds the first byte that differs wherever it lies
// (within the first eight bytes, in a later word, in the last bytes the
// final overlapping word compares) and stops at the shorter input.
func TestCommonPrefix(t *testing.T) {
	t.Parallel()
	for n := range 40 {
		a := make([]byte, n)
		for i := range a {
			a[i] = byte('a' + i%26)
		}
		for m := 0; m <= n+1; m++ { // b as long as a, shorter or longer
			b := append([]byte(nil), a[:min(m, n)]...)
			if m > n {
				b = append(b, 'x')
			}
			want := min(m, n)
			if got := commonPrefix(a, b); got != want {
				t.Fatalf("commonPrefix(%q, %q) = %d, want %d", a, b, got, want)
			}
			for d := range min(m, n) { // one byte changed
				c := append([]byte(nil), b...)
				c[d] ^= 0x20
				if got := commonPrefix(a, c); got != d {
					t.Fatalf("commonPrefix(%q, %q) = %d, want %d", a, c, got, d)
				}
			}
		}
	}
}
