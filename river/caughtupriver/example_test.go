package caughtupriver_test

import (
	"fmt"

	"github.com/riverqueue/river/rivertype"

	"github.com/caughtup/caughtup/river/caughtupriver"
)

// TokenOf reads the token Insert put in a job's metadata. A job without
// one is routed against the primary's position read after its fetch; one
// whose token does not decode reads the primary.
func ExampleTokenOf() {
	for _, md := range []string{
		`{"caughtup-token":"v1;loyw3v28;main=p.65781a3582e3401e.1.0/16B3740"}`,
		`{"snoozes":2}`,
		`{"caughtup-token":"v1;zz"}`,
	} {
		tok, ok, err := caughtupriver.TokenOf(&rivertype.JobRow{Metadata: []byte(md)})
		switch {
		case err != nil:
			fmt.Println("malformed: the job reads the primary")
		case !ok:
			fmt.Println("no token: routed by the position after the fetch")
		default:
			e, _ := tok.Entry("main")
			fmt.Println("token:", e.Database, e.LSN)
		}
	}
	// Output:
	// token: main 0/16B3740
	// no token: routed by the position after the fetch
	// malformed: the job reads the primary
}
