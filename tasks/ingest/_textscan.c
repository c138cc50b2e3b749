/* tasks.ingest._textscan: the two byte-level hot loops of ingestion, in C.
 *
 * 1. Sentence gaps: the boundaries that `tasks.ingest.sentences.BOUNDARY` (and `LINE_BREAK`) find in
 *    the "\n"-joined UTF-8 blob of a batch, as int64 (start, end) pairs of each boundary's gap.
 *    The scan replays Python `re`'s leftmost, first-alternative-wins search: at each position
 *    the terminal-punctuation branch, then the CJK branch, then the line-break branch (their
 *    first bytes are disjoint, so a switch on the byte picks the only branch that can match).
 *    Every quantifier in the pattern is followed by a byte class it cannot match, so none of
 *    them can backtrack into a different match; each branch is therefore one greedy walk.
 * 2. Clean-up: the whitespace and control-character passes of `tasks.ingest.text.clean_texts_reference`
 *    over an Arrow large_string (int64 offsets + data), applied per document in the reference's
 *    order. Unicode normalisation stays in Python, between the two calls the caller makes.
 *
 * Both release the GIL while they scan. The exact rules live in the docstrings and comments of
 * the Python references; tests/tasks/ingest/test_textscan.py checks byte equality against them.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifndef TEXTSCAN_SOURCE_SHA256
#define TEXTSCAN_SOURCE_SHA256 "unknown"
#endif

#define MAX_ABBREVIATION_BYTES 31 /* lengths are kept as bits of a uint32_t */

/* ------------------------------------------------------------------------------------------ */
/* Byte classes of Python `re` on a bytes pattern: ASCII only.                                 */

static inline int is_space(uint8_t c) { return c == ' ' || (c >= '\t' && c <= '\r'); } /* \s */
static inline int is_upper(uint8_t c) { return c >= 'A' && c <= 'Z'; }
static inline int is_digit(uint8_t c) { return c >= '0' && c <= '9'; }
static inline int is_word_or_dot(uint8_t c) /* [\w.] */
{
    return is_upper(c) || (c >= 'a' && c <= 'z') || is_digit(c) || c == '_' || c == '.';
}

static inline int at2(const uint8_t *s, Py_ssize_t n, Py_ssize_t i, uint8_t a, uint8_t b)
{
    return i + 2 <= n && s[i] == a && s[i + 1] == b;
}

static inline int at3(const uint8_t *s, Py_ssize_t n, Py_ssize_t i, uint8_t a, uint8_t b,
                      uint8_t c)
{
    return i + 3 <= n && s[i] == a && s[i + 1] == b && s[i + 2] == c;
}

/* ------------------------------------------------------------------------------------------ */
/* A growable vector of int64 gap bounds, filled without the GIL (plain malloc).               */

typedef struct {
    int64_t *v;
    size_t len; /* int64 entries, two per gap */
    size_t cap;
} GapVec;

static int gaps_push(GapVec *g, Py_ssize_t start, Py_ssize_t end)
{
    if (g->len + 2 > g->cap) {
        size_t cap = g->cap ? 2 * g->cap : 4096;
        int64_t *v = realloc(g->v, cap * sizeof(int64_t));
        if (v == NULL)
            return -1;
        g->v = v;
        g->cap = cap;
    }
    g->v[g->len++] = (int64_t)start;
    g->v[g->len++] = (int64_t)end;
    return 0;
}

/* ------------------------------------------------------------------------------------------ */
/* SentenceRules: the abbreviation forms, given once from Python, grouped by length.           */

typedef struct {
    PyObject_HEAD
    uint32_t length_mask;                     /* bit L: some form is L bytes long */
    uint8_t *forms[MAX_ABBREVIATION_BYTES + 1]; /* forms of length L, sorted, back to back */
    Py_ssize_t count[MAX_ABBREVIATION_BYTES + 1];
} RulesObject;

static void rules_clear(RulesObject *self)
{
    for (int len = 0; len <= MAX_ABBREVIATION_BYTES; len++) {
        free(self->forms[len]);
        self->forms[len] = NULL;
        self->count[len] = 0;
    }
    self->length_mask = 0;
}

static void rules_dealloc(RulesObject *self)
{
    rules_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int compare_len; /* only read by qsort during __init__, which holds the GIL */

static int compare_forms(const void *a, const void *b) { return memcmp(a, b, compare_len); }

static int rules_init(RulesObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"abbreviations", NULL};
    PyObject *words;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O:SentenceRules", kwlist, &words))
        return -1;
    PyObject *seq = PySequence_Fast(words, "abbreviations must be a sequence of bytes");
    if (seq == NULL)
        return -1;
    rules_clear(self);
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    for (int pass = 0; pass < 2; pass++) { /* pass 0 counts per length, pass 1 copies */
        Py_ssize_t filled[MAX_ABBREVIATION_BYTES + 1] = {0};
        for (Py_ssize_t k = 0; k < n; k++) {
            PyObject *word = PySequence_Fast_GET_ITEM(seq, k);
            if (!PyBytes_Check(word)) {
                PyErr_SetString(PyExc_TypeError, "abbreviations must be bytes");
                goto fail;
            }
            Py_ssize_t len = PyBytes_GET_SIZE(word);
            if (len < 1 || len > MAX_ABBREVIATION_BYTES) {
                PyErr_Format(PyExc_ValueError, "an abbreviation must be 1 to %d bytes, not %zd",
                             MAX_ABBREVIATION_BYTES, len);
                goto fail;
            }
            for (Py_ssize_t b = 0; b < len; b++) {
                if (!is_word_or_dot((uint8_t)PyBytes_AS_STRING(word)[b])) {
                    PyErr_Format(PyExc_ValueError,
                                 "an abbreviation must be ASCII letters, digits, '_' or '.', "
                                 "not %R",
                                 word);
                    goto fail;
                }
            }
            if (pass == 0) {
                self->count[len]++;
            } else {
                memcpy(self->forms[len] + len * filled[len]++, PyBytes_AS_STRING(word), len);
            }
        }
        if (pass == 0) {
            for (int len = 1; len <= MAX_ABBREVIATION_BYTES; len++) {
                if (self->count[len] == 0)
                    continue;
                self->forms[len] = malloc((size_t)(len * self->count[len]));
                if (self->forms[len] == NULL) {
                    PyErr_NoMemory();
                    goto fail;
                }
                self->length_mask |= (uint32_t)1 << len;
            }
        }
    }
    for (int len = 1; len <= MAX_ABBREVIATION_BYTES; len++) {
        if (self->count[len] == 0)
            continue;
        compare_len = len;
        qsort(self->forms[len], (size_t)self->count[len], (size_t)len, compare_forms);
    }
    Py_DECREF(seq);
    return 0;
fail:
    rules_clear(self);
    Py_DECREF(seq);
    return -1;
}

static int is_form(const RulesObject *r, int len, const uint8_t *word)
{
    Py_ssize_t lo = 0, hi = r->count[len];
    const uint8_t *forms = r->forms[len];
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        int cmp = memcmp(forms + len * mid, word, len);
        if (cmp == 0)
            return 1;
        if (cmp < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    return 0;
}

/* The negative lookbehinds of `_PERIOD`, for the lone '.' at s[p]: 1 when one of them fails.
 * `^` is MULTILINE: the blob start or just after '\n' (and '\n' is in \s and outside [\w.]). */
static int period_is_exception(const RulesObject *r, const uint8_t *s, Py_ssize_t p)
{
    if (p >= 1 && is_upper(s[p - 1])) {
        if (p == 1)
            return 1; /* ^[A-Z]\.  */
        uint8_t b = s[p - 2];
        if (is_space(b) || b == '(' || b == '"' || b == '\'' || b == '.')
            return 1; /* [\s("'][A-Z]\.  (an initial) and \.[A-Z]\.  (U.S., Ph.D.) */
    }
    for (Py_ssize_t k = 1; k <= 3 && k <= p && is_digit(s[p - k]); k++) {
        if (p - k == 0 || s[p - k - 1] == '\n')
            return 1; /* ^\d{1,3}\.  (a leading enumerator) */
    }
    /* Forms are [\w.]+ (checked in __init__), so only the whole [\w.] run before the period can
     * be one with [^\w.] or ^ before it: one lookup per period, not one per form length. */
    Py_ssize_t start = p;
    while (start > 0 && p - start <= MAX_ABBREVIATION_BYTES && is_word_or_dot(s[start - 1]))
        start--;
    Py_ssize_t len = p - start;
    if (len == 0 || len > MAX_ABBREVIATION_BYTES || !((r->length_mask >> len) & 1))
        return 0; /* (a run longer than any form stops the loop with len > the maximum) */
    return is_form(r, (int)len, s + start);
}

/* _CLOSE*: ' " ) ] and U+201D U+2019 U+00BB. */
static inline Py_ssize_t skip_closing(const uint8_t *s, Py_ssize_t n, Py_ssize_t t)
{
    for (;;) {
        if (t < n && (s[t] == '\'' || s[t] == '"' || s[t] == ')' || s[t] == ']'))
            t += 1;
        else if (at3(s, n, t, 0xe2, 0x80, 0x9d) || at3(s, n, t, 0xe2, 0x80, 0x99))
            t += 3;
        else if (at2(s, n, t, 0xc2, 0xbb))
            t += 2;
        else
            return t;
    }
}

/* _OPEN*: ' " ( [ and U+201C U+2018 U+00AB. */
static inline Py_ssize_t skip_opening(const uint8_t *s, Py_ssize_t n, Py_ssize_t u)
{
    for (;;) {
        if (u < n && (s[u] == '\'' || s[u] == '"' || s[u] == '(' || s[u] == '['))
            u += 1;
        else if (at3(s, n, u, 0xe2, 0x80, 0x9c) || at3(s, n, u, 0xe2, 0x80, 0x98))
            u += 3;
        else if (at2(s, n, u, 0xc2, 0xab))
            u += 2;
        else
            return u;
    }
}

/* _CAPITAL: A-Z, 0-9 and the Latin-1, Greek and Cyrillic capitals (as UTF-8 byte ranges). */
static inline int capital_at(const uint8_t *s, Py_ssize_t n, Py_ssize_t u)
{
    if (u >= n)
        return 0;
    uint8_t c = s[u];
    if (is_upper(c) || is_digit(c))
        return 1;
    if (u + 1 >= n)
        return 0;
    uint8_t d = s[u + 1];
    if (c == 0xc3)
        return (d >= 0x80 && d <= 0x96) || (d >= 0x98 && d <= 0x9e);
    if (c == 0xce)
        return d >= 0x91 && d <= 0xa9;
    if (c == 0xd0)
        return d >= 0x90 && d <= 0xaf;
    return 0;
}

/* `([ \t]*\n\s*)` for the '\n' at s[j]. Its leftmost match starts at the [ \t] run just before
 * the '\n', which never reaches back past `from`: the scan's resume point, where every earlier
 * position was consumed by a match or failed. Spaces and tabs therefore need no attempt of
 * their own: nothing else can start at them. Sets *end to the match end. */
static inline int push_line_break(const uint8_t *s, Py_ssize_t n, Py_ssize_t from, Py_ssize_t j,
                                  GapVec *g, Py_ssize_t *end)
{
    Py_ssize_t start = j, t = j + 1;
    while (start > from && (s[start - 1] == ' ' || s[start - 1] == '\t'))
        start--;
    while (t < n && is_space(s[t]))
        t++;
    *end = t;
    return gaps_push(g, start, t);
}

static int scan_lines(const uint8_t *s, Py_ssize_t n, GapVec *g)
{
    Py_ssize_t i = 0;
    while (i < n) {
        const uint8_t *nl = memchr(s + i, '\n', (size_t)(n - i));
        if (nl == NULL)
            return 0;
        if (push_line_break(s, n, i, nl - s, g, &i) < 0)
            return -1;
    }
    return 0;
}

/* The bytes at which a BOUNDARY match can start (besides the spaces before a '\n'). */
static const uint8_t RULE_START[256] = {
    ['.'] = 1, ['!'] = 1, ['?'] = 1, ['\n'] = 1, [0xe2] = 1, [0xe3] = 1, [0xef] = 1,
};

static int scan_rules(const RulesObject *r, const uint8_t *s, Py_ssize_t n, GapVec *g)
{
    Py_ssize_t i = 0;
    while (i < n) {
        Py_ssize_t from = i;
        while (i < n && !RULE_START[s[i]])
            i++;
        if (i >= n)
            break;
        uint8_t c = s[i];
        Py_ssize_t t, resume;
        switch (c) {
        case '.':
        case '!':
        case '?':
        case 0xe2: /* _TERMINAL _CLOSE* (\s+) (?=_OPEN* _CAPITAL) */
            if (c == '.') {
                Py_ssize_t run = i + 1;
                while (run < n && s[run] == '.')
                    run++;
                /* Every start inside a failed run of dots fails the same way. */
                resume = run;
                if (run - i >= 2)
                    t = run; /* \.\.+ (a lone-period match needs (?!\.)) */
                else if ((i >= 1 && s[i - 1] == '.') || period_is_exception(r, s, i)) {
                    i = resume;
                    continue;
                } else
                    t = i + 1;
            } else if (c == 0xe2) {
                if (!at3(s, n, i, 0xe2, 0x80, 0xa6)) { /* U+2026 HORIZONTAL ELLIPSIS */
                    i++;
                    continue;
                }
                t = i + 3;
                resume = i + 1;
            } else {
                t = i + 1; /* [!?][.!?]*: every start inside the run ends where it ends */
                while (t < n && (s[t] == '.' || s[t] == '!' || s[t] == '?'))
                    t++;
                resume = t;
            }
            t = skip_closing(s, n, t);
            {
                Py_ssize_t gap = t;
                while (t < n && is_space(s[t]))
                    t++;
                if (t > gap && capital_at(s, n, skip_opening(s, n, t))) {
                    if (gaps_push(g, gap, t) < 0)
                        return -1;
                    i = t;
                } else {
                    i = resume;
                }
            }
            continue;
        case 0xe3:
        case 0xef: /* _CJK (\s*): U+3002, U+FF01, U+FF1F, then U+300D U+300F U+FF09 */
            if (!at3(s, n, i, 0xe3, 0x80, 0x82) && !at3(s, n, i, 0xef, 0xbc, 0x81) &&
                !at3(s, n, i, 0xef, 0xbc, 0x9f)) {
                i++;
                continue;
            }
            t = i + 3;
            while (at3(s, n, t, 0xe3, 0x80, 0x8d) || at3(s, n, t, 0xe3, 0x80, 0x8f) ||
                   at3(s, n, t, 0xef, 0xbc, 0x89))
                t += 3;
            {
                Py_ssize_t gap = t;
                while (t < n && is_space(s[t]))
                    t++;
                if (gaps_push(g, gap, t) < 0)
                    return -1;
            }
            i = t;
            continue;
        case '\n': /* ([ \t]*\n\s*) */
            if (push_line_break(s, n, from, i, g, &i) < 0)
                return -1;
            continue;
        default:
            i++;
        }
    }
    return 0;
}

/* Run a scan over `blob` without the GIL; return the gaps as bytes of int64 pairs. */
static PyObject *gaps_to_bytes(const RulesObject *rules, PyObject *blob)
{
    Py_buffer view;
    if (PyObject_GetBuffer(blob, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    GapVec g = {NULL, 0, 0};
    int rc;
    Py_BEGIN_ALLOW_THREADS
    if (rules != NULL)
        rc = scan_rules(rules, (const uint8_t *)view.buf, view.len, &g);
    else
        rc = scan_lines((const uint8_t *)view.buf, view.len, &g);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    PyObject *out = NULL;
    if (rc < 0)
        PyErr_NoMemory();
    else
        out = PyBytes_FromStringAndSize((const char *)g.v, (Py_ssize_t)(g.len * sizeof(int64_t)));
    free(g.v);
    return out;
}

static PyObject *rules_gaps(RulesObject *self, PyObject *blob) { return gaps_to_bytes(self, blob); }

static PyMethodDef rules_methods[] = {
    {"gaps", (PyCFunction)rules_gaps, METH_O,
     "gaps(blob) -> bytes: the (start, end) int64 pairs of every BOUNDARY gap in `blob`."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject RulesType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "tasks.ingest._textscan.SentenceRules",
    .tp_basicsize = sizeof(RulesObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "SentenceRules(abbreviations): the BOUNDARY scan with these abbreviation forms.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)rules_init,
    .tp_dealloc = (destructor)rules_dealloc,
    .tp_methods = rules_methods,
};

static PyObject *line_gaps(PyObject *module, PyObject *blob)
{
    (void)module;
    return gaps_to_bytes(NULL, blob);
}

/* ------------------------------------------------------------------------------------------ */
/* Clean-up, one document at a time. Each step reads `in[0:n]`, writes `out` and returns the   */
/* new length, which is never more than n (every rewrite replaces a run by at most its bytes). */

enum {
    OP_NEWLINES = 1,      /* \r\n? -> \n */
    OP_STRIP_CONTROL = 2, /* drop [\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\ufeff] */
    OP_COLLAPSE = 4,      /* [\t\v\f\p{Zs}]+ -> ' ', then ' ?\n ?' -> \n, then \n{3,} -> \n\n */
    OP_JOIN = 8,          /* \n{2,} -> \x01, \n -> ' ', \x01 -> \n (then ' {2,}' -> ' ') */
    OP_TRIM = 16,         /* Arrow's utf8_trim_whitespace */
};

/* Bytes the clean-up steps may rewrite, and bytes an hspace character may start with; both
 * filled once at import. The steps copy runs of other bytes with memcpy. */
static uint8_t CONTROL_LEAD[256], HSPACE_LEAD[256];

static void fill_tables(void)
{
    for (int c = 0; c < 0x20; c++)
        CONTROL_LEAD[c] = 1; /* \r and the C0 controls (\t and \n are copied) */
    CONTROL_LEAD[0x7f] = CONTROL_LEAD[0xc2] = CONTROL_LEAD[0xef] = 1;
    HSPACE_LEAD[' '] = HSPACE_LEAD['\t'] = HSPACE_LEAD[0x0b] = HSPACE_LEAD[0x0c] = 1;
    HSPACE_LEAD[0xc2] = HSPACE_LEAD[0xe1] = HSPACE_LEAD[0xe2] = HSPACE_LEAD[0xe3] = 1;
}

static size_t step_newlines_controls(const uint8_t *in, size_t n, uint8_t *out, int newlines,
                                     int strip)
{
    size_t o = 0, i = 0;
    for (;;) {
        size_t j = i;
        while (j < n && !CONTROL_LEAD[in[j]])
            j++;
        memcpy(out + o, in + i, j - i);
        o += j - i;
        i = j;
        if (i >= n)
            return o;
        uint8_t c = in[i];
        if (newlines && c == '\r') { /* decided on the input, as the reference's first pass */
            out[o++] = '\n';
            i += (i + 1 < n && in[i + 1] == '\n') ? 2 : 1;
            continue;
        }
        if (strip) {
            if (c < 0x20 ? (c != '\t' && c != '\n' && c != '\r') : c == 0x7f) {
                i++;
                continue;
            }
            if (c == 0xc2 && i + 1 < n && in[i + 1] >= 0x80 && in[i + 1] <= 0x9f) {
                i += 2; /* U+0080..U+009F */
                continue;
            }
            if (c == 0xef && i + 2 < n && in[i + 1] == 0xbb && in[i + 2] == 0xbf) {
                i += 3; /* U+FEFF */
                continue;
            }
        }
        out[o++] = c;
        i++;
    }
}

/* Bytes of the [\t\v\f\p{Zs}] character at in[i], or 0. Zs as in pyarrow 25's RE2: U+0020,
 * U+00A0, U+1680, U+2000..U+200A, U+202F, U+205F, U+3000. */
static inline size_t hspace_at(const uint8_t *in, size_t n, size_t i)
{
    uint8_t c = in[i];
    if (c == ' ' || c == '\t' || c == 0x0b || c == 0x0c)
        return 1;
    if (c < 0xc2)
        return 0;
    if (c == 0xc2)
        return (i + 1 < n && in[i + 1] == 0xa0) ? 2 : 0;
    if (i + 2 >= n)
        return 0;
    uint8_t b = in[i + 1], d = in[i + 2];
    if (c == 0xe1)
        return (b == 0x9a && d == 0x80) ? 3 : 0;
    if (c == 0xe2)
        return ((b == 0x80 && ((d >= 0x80 && d <= 0x8a) || d == 0xaf)) ||
                (b == 0x81 && d == 0x9f))
                   ? 3
                   : 0;
    if (c == 0xe3)
        return (b == 0x80 && d == 0x80) ? 3 : 0;
    return 0;
}

static size_t step_collapse_hspace(const uint8_t *in, size_t n, uint8_t *out)
{
    size_t o = 0, i = 0;
    for (;;) {
        size_t j = i; /* a run without hspace, or with single spaces only */
        while (j < n && (!HSPACE_LEAD[in[j]] ||
                         (in[j] == ' ' && (j + 1 == n || !HSPACE_LEAD[in[j + 1]]))))
            j++;
        memcpy(out + o, in + i, j - i);
        o += j - i;
        i = j;
        if (i >= n)
            return o;
        size_t k = hspace_at(in, n, i);
        if (k == 0) {
            out[o++] = in[i++];
            continue;
        }
        out[o++] = ' ';
        for (i += k; i < n && (k = hspace_at(in, n, i)) != 0; i += k) {
        }
    }
}

static size_t step_trim_newline_spaces(const uint8_t *in, size_t n, uint8_t *out) /* ' ?\n ?' */
{
    size_t o = 0, i = 0;
    while (i < n) {
        if (in[i] == '\n' || (in[i] == ' ' && i + 1 < n && in[i + 1] == '\n')) {
            i += in[i] == '\n' ? 1 : 2;
            if (i < n && in[i] == ' ')
                i++;
            out[o++] = '\n';
        } else {
            out[o++] = in[i++];
        }
    }
    return o;
}

static size_t step_squeeze_blank_lines(const uint8_t *in, size_t n, uint8_t *out) /* \n{3,} */
{
    size_t o = 0, i = 0;
    while (i < n) {
        if (in[i] != '\n') {
            out[o++] = in[i++];
            continue;
        }
        size_t run = 0;
        for (; i < n && in[i] == '\n'; i++)
            run++;
        out[o++] = '\n';
        if (run >= 2)
            out[o++] = '\n';
    }
    return o;
}

/* \n{2,} -> \x01, then \n -> ' ', then every \x01 (also one that was in the text) -> \n. */
static size_t step_join_lines(const uint8_t *in, size_t n, uint8_t *out)
{
    size_t o = 0, i = 0;
    while (i < n) {
        if (in[i] == '\n') {
            size_t run = 0;
            for (; i < n && in[i] == '\n'; i++)
                run++;
            out[o++] = run >= 2 ? '\n' : ' ';
        } else {
            out[o++] = in[i] == 0x01 ? '\n' : in[i];
            i++;
        }
    }
    return o;
}

static size_t step_squeeze_spaces(const uint8_t *in, size_t n, uint8_t *out) /* ' {2,}' */
{
    size_t o = 0;
    for (size_t i = 0; i < n; i++) {
        if (in[i] == ' ' && i > 0 && in[i - 1] == ' ')
            continue;
        out[o++] = in[i];
    }
    return o;
}

/* Bytes of the trailing/leading Arrow whitespace character, or 0: ASCII \t..\r, \x1c..\x1f,
 * ' ', and U+0085, U+00A0, U+1680, U+2000..U+200A, U+2028, U+2029, U+202F, U+205F, U+3000. */
static inline int is_trim_ascii(uint8_t c) { return (c >= 0x09 && c <= 0x0d) || (c >= 0x1c && c <= 0x20); }

static inline int is_trim3(uint8_t a, uint8_t b, uint8_t c)
{
    if (a == 0xe1)
        return b == 0x9a && c == 0x80;
    if (a == 0xe2)
        return (b == 0x80 && ((c >= 0x80 && c <= 0x8a) || c == 0xa8 || c == 0xa9 || c == 0xaf)) ||
               (b == 0x81 && c == 0x9f);
    if (a == 0xe3)
        return b == 0x80 && c == 0x80;
    return 0;
}

static size_t leading_space(const uint8_t *s, size_t n, size_t i)
{
    if (is_trim_ascii(s[i]))
        return 1;
    if (s[i] == 0xc2 && i + 1 < n && (s[i + 1] == 0x85 || s[i + 1] == 0xa0))
        return 2;
    if (i + 2 < n && is_trim3(s[i], s[i + 1], s[i + 2]))
        return 3;
    return 0;
}

static size_t trailing_space(const uint8_t *s, size_t lo, size_t hi) /* character ending at hi */
{
    if (is_trim_ascii(s[hi - 1]))
        return 1;
    if (hi - lo >= 2 && s[hi - 2] == 0xc2 && (s[hi - 1] == 0x85 || s[hi - 1] == 0xa0))
        return 2;
    if (hi - lo >= 3 && is_trim3(s[hi - 3], s[hi - 2], s[hi - 1]))
        return 3;
    return 0;
}

/* Clean one document from `src` into `dst` (room for n bytes); a and b are scratch of n bytes. */
static size_t clean_one(const uint8_t *src, size_t n, uint8_t *dst, uint8_t *a, uint8_t *b,
                        int ops)
{
    const uint8_t *cur = src;
    uint8_t *scratch[2] = {a, b}; /* a step never writes the buffer it reads */
    int turn = 0;
#define NEXT scratch[turn]
#define APPLY(call)                                                                            \
    do {                                                                                       \
        n = (call);                                                                            \
        cur = scratch[turn];                                                                   \
        turn ^= 1;                                                                             \
    } while (0)
    if (ops & (OP_NEWLINES | OP_STRIP_CONTROL))
        APPLY(step_newlines_controls(cur, n, NEXT, ops & OP_NEWLINES, ops & OP_STRIP_CONTROL));
    if (ops & OP_COLLAPSE) {
        APPLY(step_collapse_hspace(cur, n, NEXT));
        if (memchr(cur, '\n', n) != NULL) { /* both steps only rewrite around newlines */
            APPLY(step_trim_newline_spaces(cur, n, NEXT));
            APPLY(step_squeeze_blank_lines(cur, n, NEXT));
        }
    }
    if ((ops & OP_JOIN) && (memchr(cur, '\n', n) != NULL || memchr(cur, 0x01, n) != NULL)) {
        APPLY(step_join_lines(cur, n, NEXT));
        if (ops & OP_COLLAPSE)
            APPLY(step_squeeze_spaces(cur, n, NEXT));
    }
#undef APPLY
#undef NEXT
    size_t lo = 0, hi = n, k;
    if (ops & OP_TRIM) {
        while (lo < hi && (k = leading_space(cur, hi, lo)) != 0)
            lo += k;
        while (hi > lo && (k = trailing_space(cur, lo, hi)) != 0)
            hi -= k;
    }
    memcpy(dst, cur + lo, hi - lo);
    return hi - lo;
}

static inline int64_t load_i64(const uint8_t *p)
{
    int64_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

static PyObject *clean_utf8(PyObject *module, PyObject *args)
{
    (void)module;
    PyObject *offsets_obj, *data_obj;
    int ops;
    if (!PyArg_ParseTuple(args, "OOi:clean_utf8", &offsets_obj, &data_obj, &ops))
        return NULL;
    Py_buffer offsets, data;
    if (PyObject_GetBuffer(offsets_obj, &offsets, PyBUF_SIMPLE) < 0)
        return NULL;
    if (PyObject_GetBuffer(data_obj, &data, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&offsets);
        return NULL;
    }
    PyObject *out_offsets = NULL, *out_data = NULL, *result = NULL;
    const uint8_t *off = (const uint8_t *)offsets.buf;
    Py_ssize_t count = offsets.len / 8 - 1; /* documents */
    if (offsets.len % 8 != 0 || count < 0) {
        PyErr_SetString(PyExc_ValueError, "offsets must hold n + 1 int64 values");
        goto done;
    }
    int64_t first = load_i64(off), total = 0, widest = 0;
    for (Py_ssize_t k = 0; k < count; k++) {
        int64_t lo = load_i64(off + 8 * k), hi = load_i64(off + 8 * (k + 1));
        if (lo < 0 || hi < lo || hi > data.len) {
            PyErr_SetString(PyExc_ValueError, "offsets are not increasing within the data");
            goto done;
        }
        widest = hi - lo > widest ? hi - lo : widest;
    }
    total = count > 0 ? load_i64(off + 8 * count) - first : 0;
    out_offsets = PyBytes_FromStringAndSize(NULL, 8 * (count + 1));
    out_data = PyBytes_FromStringAndSize(NULL, total);
    uint8_t *scratch = malloc(2 * (size_t)widest + 1);
    if (out_offsets == NULL || out_data == NULL || scratch == NULL) {
        free(scratch);
        if (!PyErr_Occurred())
            PyErr_NoMemory();
        goto done;
    }
    int64_t written = 0;
    Py_BEGIN_ALLOW_THREADS
    int64_t *dst_off = (int64_t *)PyBytes_AS_STRING(out_offsets);
    uint8_t *dst = (uint8_t *)PyBytes_AS_STRING(out_data);
    const uint8_t *src = (const uint8_t *)data.buf;
    dst_off[0] = 0;
    for (Py_ssize_t k = 0; k < count; k++) {
        int64_t lo = load_i64(off + 8 * k), hi = load_i64(off + 8 * (k + 1));
        written += (int64_t)clean_one(src + lo, (size_t)(hi - lo), dst + written, scratch,
                                      scratch + widest, ops);
        dst_off[k + 1] = written;
    }
    Py_END_ALLOW_THREADS
    free(scratch);
    if (_PyBytes_Resize(&out_data, (Py_ssize_t)written) < 0)
        goto done; /* out_data is already NULL */
    result = PyTuple_Pack(2, out_offsets, out_data);
done:
    Py_XDECREF(out_offsets);
    Py_XDECREF(out_data);
    PyBuffer_Release(&offsets);
    PyBuffer_Release(&data);
    return result;
}

/* ------------------------------------------------------------------------------------------ */

static PyMethodDef module_methods[] = {
    {"line_gaps", line_gaps, METH_O,
     "line_gaps(blob) -> bytes: the (start, end) int64 pairs of every LINE_BREAK gap."},
    {"clean_utf8", clean_utf8, METH_VARARGS,
     "clean_utf8(offsets, data, ops) -> (offsets, data): clean every document of a "
     "large_string array (int64 offsets, UTF-8 data) with the OP_* steps in `ops`."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "tasks.ingest._textscan",
    "Compiled sentence-gap scan and text clean-up (see tasks/ingest/_textscan.c).", -1, module_methods,
};

PyMODINIT_FUNC PyInit__textscan(void)
{
    fill_tables();
    if (PyType_Ready(&RulesType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module_def);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "SentenceRules", (PyObject *)&RulesType) < 0 ||
        PyModule_AddIntConstant(m, "OP_NEWLINES", OP_NEWLINES) < 0 ||
        PyModule_AddIntConstant(m, "OP_STRIP_CONTROL", OP_STRIP_CONTROL) < 0 ||
        PyModule_AddIntConstant(m, "OP_COLLAPSE", OP_COLLAPSE) < 0 ||
        PyModule_AddIntConstant(m, "OP_JOIN", OP_JOIN) < 0 ||
        PyModule_AddIntConstant(m, "OP_TRIM", OP_TRIM) < 0 ||
        PyModule_AddStringConstant(m, "SOURCE_SHA256", TEXTSCAN_SOURCE_SHA256) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
