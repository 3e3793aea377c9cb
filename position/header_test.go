package position

import (
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"strings"
	"testing"
	"time"
)

func mustEncode(t *testing.T, tok Token) string {
	t.Helper()
	s, err := tok.Encode()
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func TestMergeHeader(t *testing.T) {
	t.Parallel()
	tl3Other := Epoch{SystemID: testSys + 1, Timeline: 1}
	main1 := New("main", tl1, 0x100, SourcePrimary, t0)
	main2 := New("main", tl1, 0x200, SourcePrimary, t0.Add(time.Second))
	mainTL2 := New("main", tl2, 0x150, SourcePrimary, t0.Add(2*time.Second))
	mainOther := New("main", tl3Other, 0x300, SourcePrimary, t0)
	billing := New("billing", tl1, 0x50, SourceReplica, t0.Add(-time.Second))
	malformed := "v1;zz;main=q.1.1.0/1"
	newer := "v2;anything"

	tooMany := Token{}
	for i := range MaxDatabases {
		tooMany = tooMany.Merge(New(fmt.Sprintf("d%02d", i), tl1, 1, SourcePrimary, t0))
	}

	for _, tc := range []struct {
		name     string
		existing string
		tok      Token
		want     string // "" with wantTok set: compare decoded
		wantTok  *Token
		wantErr  error
	}{
		{name: "empty header, no token", existing: "", tok: Token{}, want: ""},
		{name: "empty header, a token", existing: "", tok: main1, wantTok: &main1},
		{name: "existing header, no token", existing: mustEncode(t, main1), tok: Token{}, want: mustEncode(t, main1)},
		{name: "same database, larger LSN wins", existing: mustEncode(t, main1), tok: main2, wantTok: ptr(main1.Merge(main2))},
		{name: "same database, smaller LSN keeps the header's", existing: mustEncode(t, main2), tok: main1, wantTok: ptr(main2.Merge(main1))},
		{name: "another database joins", existing: mustEncode(t, main1), tok: billing, wantTok: ptr(main1.Merge(billing))},
		{name: "malformed existing plus a token stays malformed", existing: malformed, tok: main1, want: malformed},
		{name: "newer version plus a token stays as it is", existing: newer, tok: main1, want: newer},
		{name: "malformed existing without a token", existing: malformed, tok: Token{}, want: malformed},
		{name: "merge across timelines keeps the later timeline", existing: mustEncode(t, main1), tok: mainTL2, wantTok: ptr(main1.Merge(mainTL2))},
		{name: "merge across systems leaves the epoch unknown", existing: mustEncode(t, main1), tok: mainOther, wantTok: ptr(main1.Merge(mainOther))},
		{name: "too many databases is an error", existing: mustEncode(t, tooMany), tok: New("one-more", tl1, 1, SourcePrimary, t0), wantErr: ErrTooLarge},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := MergeHeader(tc.existing, tc.tok)
			if tc.wantErr != nil {
				if !errors.Is(err, tc.wantErr) {
					t.Fatalf("MergeHeader = %q, %v; want %v", got, err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if tc.wantTok == nil {
				if got != tc.want {
					t.Fatalf("MergeHeader = %q, want %q", got, tc.want)
				}
				return
			}
			back, err := Decode(got)
			if err != nil {
				t.Fatalf("MergeHeader wrote %q: %v", got, err)
			}
			if !reflect.DeepEqual(back.Entries, tc.wantTok.Entries) || !back.CapturedAt.Equal(tc.wantTok.CapturedAt) {
				t.Fatalf("MergeHeader = %+v\nwant %+v", back, *tc.wantTok)
			}
		})
	}

	// The cross-system merge must never compare as caught up anywhere.
	got, _ := MergeHeader(mustEncode(t, main1), mainOther)
	back, _ := Decode(got)
	if e, _ := back.Entry("main"); !e.Epoch.IsZero() {
		t.Errorf("a merge across systems kept epoch %v", e.Epoch)
	}
}

func ptr[T any](v T) *T { return &v }

func TestDecodeHeaders(t *testing.T) {
	t.Parallel()
	main1 := New("main", tl1, 0x100, SourcePrimary, t0)
	main2 := New("main", tl1, 0x200, SourceReplica, t0.Add(time.Second))
	billing := New("billing", tl1, 0x50, SourcePrimary, t0)
	dup := "v1;0;main=p.1.1.0/1;main=p.1.1.0/2"

	for _, tc := range []struct {
		name    string
		values  []string
		want    Token
		wantErr error
	}{
		{name: "no header", values: nil},
		{name: "one empty value", values: []string{""}},
		{name: "one value", values: []string{mustEncode(t, main1)}, want: main1},
		{name: "several values merge", values: []string{mustEncode(t, main1), mustEncode(t, billing), "", mustEncode(t, main2)}, want: main1.Merge(billing).Merge(main2)},
		{name: "one malformed value makes the whole header unknown", values: []string{mustEncode(t, main1), "garbage"}, wantErr: ErrMalformed},
		{name: "malformed first", values: []string{"v1;", mustEncode(t, main1)}, wantErr: ErrMalformed},
		{name: "duplicate databases within one value", values: []string{dup}, wantErr: ErrDuplicateDatabase},
		{name: "the same database in two values merges", values: []string{mustEncode(t, main2), mustEncode(t, main1)}, want: main1.Merge(main2)},
		{name: "an unknown version", values: []string{"v9;x"}, wantErr: ErrUnknownVersion},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := DecodeHeaders(tc.values...)
			if tc.wantErr != nil {
				var de *DecodeError
				if !errors.Is(err, tc.wantErr) || !errors.As(err, &de) || !got.IsZero() {
					t.Fatalf("DecodeHeaders = %+v, %v; want the zero Token and %v", got, err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(got.Entries, tc.want.Entries) || !got.CapturedAt.Equal(tc.want.CapturedAt) {
				t.Fatalf("DecodeHeaders = %+v\nwant %+v", got, tc.want)
			}
		})
	}
}

func TestDecodeErrorShowsAnEscapedExcerpt(t *testing.T) {
	t.Parallel()
	_, err := Decode("v1;0;main=p.1.1.0/1\x00\n\"evil\"")
	if err == nil || !strings.Contains(err.Error(), `\x00\n\"evil\"`) {
		t.Fatalf("error %q does not show the value escaped", err)
	}
	long := "v1;0;" + strings.Repeat("a", 300) + "=p.1.1.0/1"
	_, err = Decode(long)
	var de *DecodeError
	if !errors.As(err, &de) || len(de.Input) > maxExcerpt+2*len("…") || !strings.Contains(de.Input, "…") {
		t.Fatalf("excerpt of a long value = %q", de.Input)
	}
}

func TestZeroTokenJSONRoundTrip(t *testing.T) {
	t.Parallel()
	type job struct {
		ID    int   `json:"id"`
		Token Token `json:"token"`
	}
	for _, in := range []job{{ID: 1}, {ID: 2, Token: New("main", tl1, 0x10, SourcePrimary, t0)}} {
		b, err := json.Marshal(in)
		if err != nil {
			t.Fatal(err)
		}
		var out job
		if err := json.Unmarshal(b, &out); err != nil {
			t.Fatalf("Unmarshal(%s): %v", b, err)
		}
		if out.ID != in.ID || !reflect.DeepEqual(out.Token.Entries, in.Token.Entries) || !out.Token.CapturedAt.Equal(in.Token.CapturedAt) {
			t.Fatalf("round trip of %s: %+v, want %+v", b, out, in)
		}
	}
	var tok Token
	if err := tok.UnmarshalText([]byte("garbage")); err == nil {
		t.Fatal("UnmarshalText accepted garbage")
	}
}

func TestMergeHeaderValues(t *testing.T) {
	t.Parallel()
	main1 := New("main", tl1, 0x100, SourcePrimary, t0)
	main2 := New("main", tl1, 0x200, SourceReplica, t0.Add(time.Second))
	billing := New("billing", tl1, 0x50, SourcePrimary, t0)
	for _, tc := range []struct {
		name   string
		values []string
		want   string
	}{
		{"none", nil, ""},
		{"only empty ones", []string{"", ""}, ""},
		{"one is kept as it is, even unreadable", []string{"", "garbage"}, "garbage"},
		{"several merge", []string{mustEncode(t, main1), "", mustEncode(t, billing), mustEncode(t, main2)}, mustEncode(t, main1.Merge(billing).Merge(main2))},
		{"the first unreadable one stands for all", []string{mustEncode(t, main1), "v9;x", "garbage"}, "v9;x"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := MergeHeaderValues(tc.values...)
			if err != nil {
				t.Fatal(err)
			}
			if got != tc.want {
				t.Fatalf("MergeHeaderValues = %q, want %q", got, tc.want)
			}
		})
	}
}
