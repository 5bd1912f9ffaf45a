//! A small, dependency-free language detector for the `language:response_language` instruction
//! and the English-only case instructions.
//!
//! IFEval asks `langdetect` (a character n-gram model); we do not ship a statistical model.
//! Instead the detector decides in two stages:
//!
//! 1. **Script.** Every letter is classed by its Unicode block; the script with the most letters
//!    wins. Scripts used by one language of IFEval's list name it directly: Hangul → `ko`, kana →
//!    `ja` (Han without kana → `zh`), Thai, Hebrew, Greek, Bengali, Tamil, Telugu, Kannada,
//!    Malayalam, Gujarati, Gurmukhi (`pa`). Shared scripts are split by letters only one language
//!    uses: Arabic script → `ur` with Urdu letters (ٹ ڈ ڑ ں ے), else `fa` with Persian letters
//!    (پ چ ژ گ), else `ar`; Cyrillic → `uk` with і ї є ґ, `bg` with ъ but no ы/э, else `ru`; Devanagari → `hi`
//!    (Marathi and Nepali are not told apart from Hindi).
//! 2. **Latin script.** Words are matched against short stopword lists, and a few letters that
//!    only one language uses add evidence (ñ → es, ã õ → pt, ß → de, ł ą ę → pl, ğ ş ı → tr,
//!    ơ ư đ → vi). Detected: en, es, pt, fr, de, it, nl, pl, fi, sw, vi, tr.
//!
//! [`detect`] returns [`Detected::NoLetters`] for text without letters (IFEval counts an
//! undetectable response as following the instruction) and [`Detected::Unknown`] for letters
//! with no evidence for any language (counted as not following).

/// Language codes [`detect`] can return; a prompt file asking for another is refused on load.
pub const DETECTABLE: &[&str] = &[
    "en", "es", "pt", "fr", "de", "it", "nl", "pl", "fi", "sw", "vi", "tr", "ru", "uk", "bg", "ar",
    "fa", "ur", "hi", "bn", "ta", "te", "kn", "ml", "gu", "pa", "th", "he", "el", "ko", "ja", "zh",
];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Detected {
    Language(&'static str),
    /// Letters, but no evidence for any language this detector knows.
    Unknown,
    /// No letters at all (digits, punctuation, emoji).
    NoLetters,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Script {
    Latin,
    Cyrillic,
    Greek,
    Arabic,
    Hebrew,
    Devanagari,
    Bengali,
    Gurmukhi,
    Gujarati,
    Tamil,
    Telugu,
    Kannada,
    Malayalam,
    Thai,
    Hangul,
    Kana,
    Han,
}

fn script_of(c: char) -> Option<Script> {
    let u = c as u32;
    let s = match u {
        0x0041..=0x005A | 0x0061..=0x007A | 0x00C0..=0x024F | 0x1E00..=0x1EFF => Script::Latin,
        0x0370..=0x03FF | 0x1F00..=0x1FFF => Script::Greek,
        0x0400..=0x052F => Script::Cyrillic,
        0x0590..=0x05FF => Script::Hebrew,
        0x0600..=0x06FF | 0x0750..=0x077F | 0xFB50..=0xFDFF | 0xFE70..=0xFEFF => Script::Arabic,
        0x0900..=0x097F => Script::Devanagari,
        0x0980..=0x09FF => Script::Bengali,
        0x0A00..=0x0A7F => Script::Gurmukhi,
        0x0A80..=0x0AFF => Script::Gujarati,
        0x0B80..=0x0BFF => Script::Tamil,
        0x0C00..=0x0C7F => Script::Telugu,
        0x0C80..=0x0CFF => Script::Kannada,
        0x0D00..=0x0D7F => Script::Malayalam,
        0x0E00..=0x0E7F => Script::Thai,
        0x1100..=0x11FF | 0x3130..=0x318F | 0xAC00..=0xD7AF => Script::Hangul,
        0x3040..=0x30FF | 0x31F0..=0x31FF => Script::Kana,
        0x4E00..=0x9FFF | 0x3400..=0x4DBF => Script::Han,
        _ => return None,
    };
    // Only letters count (the blocks hold digits and punctuation of their own, too).
    c.is_alphabetic().then_some(s)
}

/// Stopwords per Latin-script language: frequent function words, lowercase.
const STOPWORDS: &[(&str, &[&str])] = &[
    (
        "en",
        &[
            "the", "and", "is", "are", "of", "to", "in", "that", "it", "with", "for", "on", "this",
            "was", "be", "as", "you", "have", "not", "they", "by", "at", "from", "or", "an", "but",
            "which", "we", "can", "will", "your", "what", "there", "their", "has", "i", "my",
        ],
    ),
    (
        "es",
        &[
            "el", "la", "los", "las", "de", "que", "y", "en", "un", "una", "es", "por", "con",
            "para", "no", "se", "del", "al", "lo", "como", "más", "pero", "su", "sus", "son",
            "está", "muy", "también", "hay", "esta", "este", "yo", "tu",
        ],
    ),
    (
        "pt",
        &[
            "o", "os", "de", "que", "e", "do", "da", "dos", "das", "em", "um", "uma", "é", "não",
            "para", "com", "por", "mais", "no", "na", "como", "mas", "são", "também", "você",
            "muito", "ao", "seu", "sua", "isso", "está", "eu",
        ],
    ),
    (
        "fr",
        &[
            "le", "la", "les", "de", "des", "du", "et", "est", "un", "une", "en", "que", "qui",
            "pas", "pour", "dans", "sur", "au", "aux", "ce", "il", "elle", "avec", "sont", "mais",
            "nous", "vous", "très", "plus", "je", "cette", "être", "ou",
        ],
    ),
    (
        "de",
        &[
            "der", "die", "das", "und", "ist", "nicht", "ein", "eine", "zu", "den", "dem", "mit",
            "von", "sich", "auf", "für", "es", "im", "auch", "sind", "wir", "ich", "sie", "aber",
            "oder", "wie", "werden", "noch", "wird", "bei", "nach", "kann", "einen",
        ],
    ),
    (
        "it",
        &[
            "il", "lo", "la", "gli", "le", "di", "che", "e", "è", "un", "una", "per", "non", "con",
            "del", "della", "sono", "nel", "nella", "da", "si", "come", "anche", "più", "ma",
            "questo", "molto", "alla", "io", "questa", "essere", "ci",
        ],
    ),
    (
        "nl",
        &[
            "de", "het", "een", "en", "van", "is", "dat", "niet", "op", "te", "zijn", "met",
            "voor", "ook", "maar", "er", "wat", "ik", "je", "als", "bij", "aan", "dit", "wordt",
            "zij", "hij", "naar", "heeft", "worden",
        ],
    ),
    (
        "pl",
        &[
            "i", "w", "na", "nie", "się", "jest", "z", "to", "że", "do", "jak", "co", "ale", "o",
            "od", "po", "tak", "są", "dla", "przez", "już", "też", "czy", "jego", "może", "oraz",
            "jako", "który", "która",
        ],
    ),
    (
        "fi",
        &[
            "ja", "on", "ei", "se", "että", "oli", "hän", "kun", "mutta", "myös", "ovat", "tämä",
            "joka", "niin", "kuin", "mitä", "sen", "vain", "ole", "olla", "voi", "jos", "ovat",
            "minä", "sinä", "tai", "kanssa",
        ],
    ),
    (
        "sw",
        &[
            "na", "ya", "wa", "ni", "kwa", "za", "katika", "cha", "hii", "kuwa", "pia", "lakini",
            "sana", "yake", "hiyo", "wake", "watu", "kama", "hata", "hivyo", "zaidi", "kwamba",
            "huo", "hilo",
        ],
    ),
    (
        "vi",
        &[
            "và", "của", "là", "có", "không", "những", "các", "một", "được", "trong", "cho",
            "người", "này", "với", "đã", "để", "khi", "như", "về", "rất", "cũng", "tôi", "bạn",
        ],
    ),
    (
        "tr",
        &[
            "ve", "bir", "bu", "da", "de", "için", "ile", "çok", "ama", "gibi", "daha", "olan",
            "ne", "var", "mi", "ben", "sen", "değil", "olarak", "kadar", "sonra", "her",
        ],
    ),
];

/// Letters that only one of the Latin-script languages above uses (one point each).
const MARK_LETTERS: &[(&str, &str)] = &[
    ("es", "ñ¿¡"),
    ("pt", "ãõ"),
    ("de", "ß"),
    ("pl", "łąęśźżń"),
    ("tr", "ğşı"),
    ("vi", "ơưđạảấầẩẫậắằẳẵặẹẻẽếềểễệỉịọỏốồổỗộớờởỡợụủứừửữựỳỵỷỹ"),
];

/// The language of `text`, as an ISO 639-1 code (see the module doc for what is detected).
pub fn detect(text: &str) -> Detected {
    let mut counts: std::collections::BTreeMap<Script, usize> = Default::default();
    for c in text.chars() {
        if let Some(s) = script_of(c) {
            *counts.entry(s).or_default() += 1;
        }
    }
    let Some((&script, _)) = counts.iter().max_by_key(|(_, &n)| n) else {
        return if text.chars().any(char::is_alphabetic) {
            Detected::Unknown
        } else {
            Detected::NoLetters
        };
    };
    let has = |set: &str| text.chars().any(|c| set.contains(c));
    let lang = match script {
        Script::Latin => return detect_latin(text),
        Script::Cyrillic => {
            if has("іїєґІЇЄҐ") {
                "uk"
            } else if has("ъЪ") && !has("ыЫэЭ") {
                "bg"
            } else {
                "ru"
            }
        }
        Script::Arabic => {
            // Urdu writes پ چ گ too, so its own letters are looked for first.
            if has("ٹڈڑںے") {
                "ur"
            } else if has("پچژگ") {
                "fa"
            } else {
                "ar"
            }
        }
        Script::Han => {
            if counts.contains_key(&Script::Kana) {
                "ja"
            } else {
                "zh"
            }
        }
        Script::Kana => "ja",
        Script::Hangul => "ko",
        Script::Greek => "el",
        Script::Hebrew => "he",
        Script::Devanagari => "hi",
        Script::Bengali => "bn",
        Script::Gurmukhi => "pa",
        Script::Gujarati => "gu",
        Script::Tamil => "ta",
        Script::Telugu => "te",
        Script::Kannada => "kn",
        Script::Malayalam => "ml",
        Script::Thai => "th",
    };
    Detected::Language(lang)
}

fn detect_latin(text: &str) -> Detected {
    let lower = text.to_lowercase();
    let mut scores: Vec<(&'static str, usize)> = STOPWORDS.iter().map(|(l, _)| (*l, 0)).collect();
    for word in lower
        .split(|c: char| !c.is_alphanumeric() && c != '\'')
        .filter(|w| !w.is_empty())
    {
        for (i, (_, words)) in STOPWORDS.iter().enumerate() {
            if words.contains(&word) {
                scores[i].1 += 1;
            }
        }
    }
    for (lang, letters) in MARK_LETTERS {
        let n = lower.chars().filter(|c| letters.contains(*c)).count();
        if let Some(s) = scores.iter_mut().find(|(l, _)| l == lang) {
            s.1 += n;
        }
    }
    // The first listed language wins a tie (English before the others).
    let best = scores
        .iter()
        .fold(None::<(&'static str, usize)>, |best, &(l, n)| match best {
            Some((_, bn)) if bn >= n => best,
            _ if n == 0 => best,
            _ => Some((l, n)),
        });
    match best {
        Some((l, _)) => Detected::Language(l),
        None => Detected::Unknown,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latin_languages_by_stopwords() {
        let cases = [
            ("en", "The cat is on the mat and it is happy with the sun."),
            (
                "es",
                "El gato está en la casa y no quiere salir por la mañana.",
            ),
            ("pt", "O gato está em casa e não quer sair com os amigos."),
            ("fr", "Le chat est dans la maison et il ne veut pas sortir."),
            (
                "de",
                "Die Katze ist im Haus und will nicht nach draußen gehen.",
            ),
            (
                "it",
                "Il gatto è nella casa e non vuole uscire con gli amici.",
            ),
            ("nl", "De kat is in het huis en wil niet naar buiten gaan."),
            ("pl", "Kot jest w domu i nie chce wyjść na dwór, bo pada."),
            (
                "fi",
                "Kissa on talossa ja se ei halua mennä ulos, koska sataa.",
            ),
            (
                "sw",
                "Paka yuko ndani ya nyumba na hataki kutoka kwa sababu ni baridi.",
            ),
            (
                "vi",
                "Con mèo ở trong nhà và không muốn ra ngoài khi trời mưa.",
            ),
            (
                "tr",
                "Kedi evde ve dışarı çıkmak istemiyor çünkü bu gün çok soğuk.",
            ),
        ];
        for (want, text) in cases {
            assert_eq!(detect(text), Detected::Language(want), "{text}");
        }
    }

    #[test]
    fn scripts_name_their_language() {
        let cases = [
            ("ru", "Кошка сидит дома и не хочет выходить."),
            ("uk", "Кішка сидить вдома і не хоче виходити."),
            ("bg", "Котката седи вкъщи и не иска да излиза."),
            ("ar", "القطة في المنزل ولا تريد الخروج."),
            ("fa", "گربه در خانه است و نمی‌خواهد بیرون برود."),
            ("hi", "बिल्ली घर में है और बाहर नहीं जाना चाहती।"),
            ("ja", "猫は家にいて、外に出たくないです。"),
            ("zh", "猫在家里，不想出去。"),
            ("ko", "고양이는 집에 있고 밖에 나가고 싶어하지 않아요."),
            ("th", "แมวอยู่ในบ้านและไม่อยากออกไปข้างนอก"),
            ("he", "החתול בבית ולא רוצה לצאת."),
            ("el", "Η γάτα είναι στο σπίτι και δεν θέλει να βγει."),
            ("bn", "বিড়ালটি ঘরে আছে এবং বাইরে যেতে চায় না।"),
        ];
        for (want, text) in cases {
            assert_eq!(detect(text), Detected::Language(want), "{text}");
        }
    }

    #[test]
    fn no_letters_and_no_evidence() {
        assert_eq!(detect("12345 !!! 3.14"), Detected::NoLetters);
        assert_eq!(detect(""), Detected::NoLetters);
        assert_eq!(detect("Xyzzy plugh qwrtp"), Detected::Unknown);
    }

    #[test]
    fn every_detectable_code_is_reachable() {
        // A code listed as detectable that `detect` can never return would make prompts asking
        // for it fail silently; the two tests above cover these codes.
        let covered = [
            "en", "es", "pt", "fr", "de", "it", "nl", "pl", "fi", "sw", "vi", "tr", "ru", "uk",
            "bg", "ar", "fa", "hi", "ja", "zh", "ko", "th", "he", "el", "bn",
        ];
        for c in covered {
            assert!(DETECTABLE.contains(&c), "{c}");
        }
        assert_eq!(
            detect("ٹماٹر اور ڈبل روٹی لے آئیں اور ساتھ میں چائے بھی بنائیں۔"),
            Detected::Language("ur")
        );
        for (want, text) in [
            ("ta", "பூனை வீட்டில் உள்ளது"),
            ("te", "పిల్లి ఇంట్లో ఉంది"),
            ("kn", "ಬೆಕ್ಕು ಮನೆಯಲ್ಲಿದೆ"),
            ("ml", "പൂച്ച വീട്ടിലുണ്ട്"),
            ("gu", "બિલાડી ઘરમાં છે"),
            ("pa", "ਬਿੱਲੀ ਘਰ ਵਿੱਚ ਹੈ"),
        ] {
            assert_eq!(detect(text), Detected::Language(want), "{text}");
        }
    }
}
