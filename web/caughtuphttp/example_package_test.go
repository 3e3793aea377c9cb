package caughtuphttp_test

import (
	"context"
	"io"
	"log"
	"net/http"
	"os"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/caughtup/caughtup/consume"
	"github.com/caughtup/caughtup/enqueue"
	"github.com/caughtup/caughtup/replay"
	"github.com/caughtup/caughtup/sign"
	"github.com/caughtup/caughtup/web/caughtuphttp"
)

// A web server whose sessions read their own writes: a handler writes on
// the primary through enqueue, and the page it redirects to reads a
// replica that has the write (or the primary), while requests without a
// session read any replica. It needs a primary with streaming replicas,
// so it is compiled, not run.
func Example() {
	ctx := context.Background()
	primary, err := pgxpool.New(ctx, "postgres://app@primary/app")
	if err != nil {
		log.Fatal(err)
	}
	defer primary.Close()
	replica, err := pgxpool.New(ctx, "postgres://app@replica1/app")
	if err != nil {
		log.Fatal(err)
	}
	defer replica.Close()

	router, err := consume.NewRouter(ctx, consume.Config{
		Databases: map[string]replay.Database{"main": {Primary: primary, Replicas: replay.Replicas(replica)}},
	})
	if err != nil {
		log.Fatal(err)
	}
	defer router.Close()
	keys, err := sign.ParseKeys(os.Getenv("SESSION_TOKEN_KEYS")) // "id:base64secret,…": the first signs
	if err != nil {
		log.Fatal(err)
	}
	mw, err := caughtuphttp.New(router, caughtuphttp.Config{Keys: keys})
	if err != nil {
		log.Fatal(err)
	}

	mux := http.NewServeMux()
	mux.HandleFunc("POST /users/{id}", func(w http.ResponseWriter, r *http.Request) {
		_, err := enqueue.InTx(r.Context(), primary, func(tx pgx.Tx) error {
			_, err := tx.Exec(r.Context(), "UPDATE users SET name = $1 WHERE id = $2", r.FormValue("name"), r.PathValue("id"))
			return err
		})
		if err != nil {
			http.Error(w, "not saved", http.StatusInternalServerError)
			return
		}
		http.Redirect(w, r, r.URL.Path, http.StatusSeeOther) // the cookie goes with it
	})
	mux.HandleFunc("GET /users/{id}", func(w http.ResponseWriter, r *http.Request) {
		var name string
		err := consume.DB(r.Context(), "main").QueryRow(r.Context(), "SELECT name FROM users WHERE id = $1", r.PathValue("id")).Scan(&name)
		if err != nil {
			http.Error(w, "not found", http.StatusNotFound)
			return
		}
		if _, err := io.WriteString(w, name); err != nil {
			log.Print(err)
		}
	})
	log.Fatal(http.ListenAndServe(":8080", mw.Handler(mux)))
}
